"""The bearer token both fronts check (`--auth-token-file`)."""

from __future__ import annotations

import hmac


def bearer_matches(given: bytes, token: bytes) -> bool:
    """Whether an Authorization value carries token as a bearer token. The scheme is case-insensitive (RFC
    7235: `bearer x` is `Bearer x`); the token is compared in constant time."""
    scheme, _, value = given.strip().partition(b" ")
    is_bearer = scheme.lower() == b"bearer"
    return hmac.compare_digest(value.strip() if is_bearer else b"", token) and is_bearer
