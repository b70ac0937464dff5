"""Who a request comes from, the same for both fronts: API keys that each name a tenant (--api-keys-file,
reloaded when the file changes) or one bearer token for everyone (--auth-token-file: the default tenant).

A keys file has one key a line: `TENANT KEY [WEIGHT]`, separated by spaces or tabs; blank lines and lines
starting with `#` are skipped. A tenant may have several keys (to rotate them), all with the same weight.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import stat
import threading
from dataclasses import dataclass, field

from service.core.request import DEFAULT_TENANT, Tenant

log = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # also a Prometheus label value and a log field
KEY = re.compile(r"[\x21-\x7e]+")  # what an Authorization header carries unchanged: visible ASCII
MIN_KEY_CHARS, MAX_KEY_CHARS = 16, 256
# a weight divides the tokens charged to its tenant: below MIN_WEIGHT the charges reach float infinity (or
# swallow every other tenant's in rounding) and admission stops being fair for everyone
MIN_WEIGHT, MAX_WEIGHT = 0.001, 1000.0
MAX_TENANTS = 1000  # the tenant label's values in the metrics are bounded by it
MAX_FILE_BYTES = 1 << 20


class KeysFileError(ValueError):
    """A keys file that cannot be used; the message names the file and the line."""


@dataclass(frozen=True)
class Keys:
    """SHA-256 digests of the keys, each with its tenant."""

    entries: tuple[tuple[bytes, Tenant], ...]
    by_digest: dict[bytes, Tenant] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_digest", dict(self.entries))  # frozen: set once, here

    @property
    def tenants(self) -> list[str]:
        return sorted({tenant.name for _, tenant in self.entries})


def parse_keys(text: str, source: str, own_cache: bool = True) -> Keys:
    """The keys of a keys file's text; KeysFileError naming `source`, the line and what is wrong with it."""
    entries: list[tuple[bytes, Tenant]] = []
    seen: dict[bytes, int] = {}  # key digest -> its line
    weights: dict[str, tuple[float, int]] = {}  # tenant -> its weight and the line that set it
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue

        def refuse(reason: str, line_number: int = number) -> KeysFileError:
            return KeysFileError(f"{source} line {line_number}: {reason}")

        if len(fields) not in (2, 3):
            raise refuse(f"expected `tenant key [weight]`, got {len(fields)} fields")
        name, key = fields[0], fields[1]
        if not TENANT_NAME.fullmatch(name):
            raise refuse("a tenant name is 1 to 64 letters, digits and ._- (starting with a letter or digit)")
        if not KEY.fullmatch(key) or not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS:
            raise refuse(f"a key is {MIN_KEY_CHARS} to {MAX_KEY_CHARS} visible ASCII characters")
        weight = _weight(fields[2]) if len(fields) == 3 else 1.0
        if weight is None:
            raise refuse(f"the weight must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}], got {fields[2][:32]!r}")
        digest = hashlib.sha256(key.encode()).digest()
        if digest in seen:
            raise refuse(f"the same key as line {seen[digest]}; each key names one tenant")
        seen[digest] = number
        earlier = weights.setdefault(name, (weight, number))
        if earlier[0] != weight:
            raise refuse(f"tenant {name} has weight {earlier[0]:g} on line {earlier[1]}; its keys share one weight")
        if len(weights) > MAX_TENANTS:
            raise refuse(f"more than {MAX_TENANTS} tenants")
        entries.append((digest, Tenant(name, weight, own_cache)))
    if not entries:
        raise KeysFileError(f"{source}: no keys (lines of `tenant key [weight]`)")
    return Keys(tuple(entries))


def _weight(text: str) -> float | None:
    try:
        weight = float(text)
    except ValueError:
        return None
    return weight if MIN_WEIGHT <= weight <= MAX_WEIGHT and math.isfinite(weight) else None


def read_text_file(path: str) -> str:
    """A keys or token file's text: a regular file (a FIFO or a device would block the reading thread for good:
    opened without waiting, then refused) of at most MAX_FILE_BYTES of UTF-8; KeysFileError naming the file (and
    the line) otherwise, OSError when it cannot be read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise KeysFileError(f"{path}: not a regular file")
    with os.fdopen(fd, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise KeysFileError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise KeysFileError(f"{path} line {line}: not UTF-8 text") from None


def read_keys(path: str, own_cache: bool = True) -> Keys:
    """The keys in a keys file; KeysFileError (OSError for a file that cannot be read) naming the file."""
    return parse_keys(read_text_file(path), path, own_cache)


def bearer_token(given: bytes) -> bytes | None:
    """The token of an Authorization value (`Bearer <token>`; the scheme is case-insensitive, RFC 7235), or
    None when it is not one."""
    scheme, _, value = given.strip().partition(b" ")
    return value.strip() if scheme.lower() == b"bearer" else None


class Auth:
    """The current keys and the tenant each names. Without keys every request is the default tenant's."""

    def __init__(self, keys: Keys | None = None, path: str | None = None, own_cache: bool = True) -> None:
        self.keys, self.path, self.own_cache = keys, path, own_cache
        self._seen = _signature(path) if path else None
        self._reloading = threading.Lock()  # one read at a time: a slower, older read never wins over a newer one

    @classmethod
    def from_files(cls, token_file: str | None, keys_file: str | None, share_cache: bool = False) -> Auth:
        """From the config's files; ValueError (KeysFileError) naming what is wrong with them."""
        if token_file and keys_file:
            raise ValueError("--auth-token-file and --api-keys-file exclude each other: put the token in the keys file")
        if keys_file:
            signature = _signature(keys_file)
            auth = cls(read_keys(keys_file, not share_cache), keys_file, not share_cache)
            auth._seen = signature
            return auth
        if token_file:
            token = read_text_file(token_file).strip()
            if not token:
                raise ValueError("the auth token file is empty")
            return cls(Keys(((hashlib.sha256(token.encode()).digest(), DEFAULT_TENANT),)))
        return cls()

    @property
    def required(self) -> bool:
        return self.keys is not None

    @property
    def tenants(self) -> list[str]:
        return self.keys.tenants if self.keys is not None else [DEFAULT_TENANT.name]

    def tenant_of(self, authorization: bytes | None) -> Tenant | None:
        """The tenant whose key an Authorization value carries; None when it carries none of the keys. The token's
        SHA-256 digest is looked up: the time a lookup takes tells a caller about digests, which say nothing of
        the keys, and it does not grow with the number of keys (comparing each was ~3 ms for a 1 MiB file)."""
        keys = self.keys  # one snapshot: a reload replaces it whole
        if keys is None:
            return DEFAULT_TENANT
        token = bearer_token(authorization or b"")
        return keys.by_digest.get(hashlib.sha256(token).digest()) if token else None

    def reload(self, force: bool = False) -> bool:
        """Read the keys file again if it changed (or when forced, on SIGHUP); True when new keys apply. A file
        that cannot be read or used leaves the keys as they were, with one warning per change of the file."""
        if self.path is None:
            return False
        with self._reloading:
            signature = _signature(self.path)
            if signature == self._seen and not force:
                return False
            self._seen = signature
            try:
                keys = read_keys(self.path, self.own_cache)
            except (OSError, ValueError) as exc:
                log.warning("keeping the previous API keys: %s", exc)
                return False
            self.keys = keys
        log.info("API keys reloaded from %s: %d keys of %d tenants", self.path, len(keys.entries), len(keys.tenants))
        return True


def _signature(path: str) -> tuple[int, ...]:
    """What tells a changed file (a Kubernetes Secret is replaced through a symbolic link: a new inode)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return (-1, exc.errno or 0)
    return (st.st_ino, st.st_size, st.st_mtime_ns)
