"""KV blocks in a store every replica of a model shares: the fleet cache, on the Redis 7 / Valkey protocol.

A block is one string value under a key made of a prefix per engine identity and the block's chained digest
(which already holds the request's cache_salt, so tenants never share a key): `ovkv:<identity>:<digest>` in hex.
The value is the disk tier's integrity header (magic, version, identity, digest, length, CRC-32) followed by the
payload, and it is checked before use: anything else under a key (another length, a bad checksum, another
identity or digest, a key of another type) is counted as corrupt, warned about once, deleted, and never loaded.
A read asks for at most one byte more than a block's size, so a hostile huge value costs nothing to refuse.

Nothing here runs on the engine thread: the remote tier's threads call it. Every call is bounded by the socket
timeout and never retried inside the client; a failure marks the store down (one warning per outage), and it is
tried again after a backoff that doubles up to MAX_BACKOFF_SECONDS. The store bounds itself: run it with
`maxmemory` and `allkeys-lru` (docs/DEPLOY.md); an optional TTL expires blocks unused for that long.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from service.engine.disk_store import HEADER, block_header, checked_block

log = logging.getLogger(__name__)

KEY_PREFIX = "ovkv"
FIRST_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 30.0


@dataclass
class RemoteCounters:
    num_published: int = 0  # blocks stored
    num_fetched: int = 0  # blocks read and verified
    num_missed: int = 0  # fetches whose chain ended at an absent key
    num_corrupt: int = 0  # values refused: wrong length, checksum, identity or digest, or a key of another type
    num_errors: int = 0  # operations that failed: unreachable, timed out, refused (a wrong password, a full store)
    num_outages: int = 0  # times the store went from answering (or starting) to down
    bytes_published: int = 0
    bytes_fetched: int = 0


def redacted(url: str) -> str:
    """The store's address for logs and metrics: scheme, host, port and database, never a user or password."""
    try:
        parts = urlsplit(url)
        port = f":{parts.port}" if parts.port else ""
        host = parts.hostname or ""
    except ValueError:
        return "(an unparsable URL)"
    return f"{parts.scheme}://{host}{port}{parts.path}"


def read_password(path: str) -> str:
    """A password file's content without its trailing newline (a Kubernetes Secret mounted as a file)."""
    with open(path, encoding="utf-8") as f:
        return f.read().rstrip("\r\n")


class RemoteStore:
    def __init__(
        self,
        url: str,
        identity: bytes,
        payload_bytes: int,
        password: str | None = None,
        ttl_seconds: float = 0.0,
        timeout: float = 1.0,
        ca_cert: str | None = None,
    ) -> None:
        self.where = redacted(url)
        self.identity = identity
        self.payload_bytes = payload_bytes
        self.value_bytes = HEADER.size + payload_bytes
        self.ttl_ms = int(ttl_seconds * 1000) or None
        self.prefix = f"{KEY_PREFIX}:{identity.hex()[:32]}:".encode()
        options: dict[str, object] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(NoBackoff(), 0),  # the tier decides when to try again, never a stalled call
        }
        if password is not None:
            options["password"] = password
        if ca_cert:
            options["ssl_ca_certs"] = ca_cert
        self.client = redis.Redis.from_url(url, **options)
        self.counters = RemoteCounters()
        self.up = False  # the last operation succeeded: fetches are tried
        self._lock = threading.Lock()
        self._next_try = 0.0
        self._backoff = FIRST_BACKOFF_SECONDS
        self._warned_down = False  # one warning per outage
        self._warned_refused = False  # one warning per episode of refused writes
        self._warned_corrupt = False  # one warning in all: further ones are counted

    def key(self, digest: bytes) -> bytes:
        return self.prefix + digest.hex().encode()

    # -- health ------------------------------------------------------------------------------------------
    def check(self) -> bool:
        """True when the store answers. While it is down, pings it once its backoff has passed."""
        if self.up:
            return True
        if time.monotonic() < self._next_try:
            return False
        try:
            self.client.ping()
        # not only RedisError: an endpoint that speaks something else makes the client fail in other ways (an
        # AttributeError in its handshake), and the store is then as unusable as one that is down
        except Exception as exc:
            self._failed(exc)
            return False
        self._answered()
        return True

    def _answered(self) -> None:
        with self._lock:
            if not self.up and self._warned_down:
                log.info("kv remote tier: %s answers again", self.where)
            elif not self.up:
                log.info("kv remote tier: %s connected", self.where)
            self.up, self._warned_down, self._backoff = True, False, FIRST_BACKOFF_SECONDS

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self.counters.num_errors += 1
            self.up = False
            self._next_try = time.monotonic() + self._backoff
            if not self._warned_down:
                self._warned_down = True
                self.counters.num_outages += 1
                if isinstance(exc, redis.AuthenticationError):
                    why = "refused the credentials (check --kv-remote-password-file, or the user in --kv-remote-url)"
                else:
                    why = f"does not answer ({type(exc).__name__}: {exc})"
                log.warning(
                    "kv remote tier: %s %s; serving without it (prefixes are computed), trying again every %.0f s "
                    "at most",
                    self.where,
                    why,
                    MAX_BACKOFF_SECONDS,
                )
            self._backoff = min(self._backoff * 2, MAX_BACKOFF_SECONDS)

    # -- blocks ------------------------------------------------------------------------------------------
    def fetch(self, digests: Sequence[bytes]) -> list[memoryview]:
        """The verified payloads of digests' blocks, from the first on, up to the first that is absent or refused
        (all of them when every one passes), in one pipelined round trip. Store trouble ends the list early."""
        if not digests:
            return []
        pipe = self.client.pipeline(transaction=False)
        for digest in digests:
            pipe.getrange(self.key(digest), 0, self.value_bytes)  # inclusive end: a longer value shows
            if self.ttl_ms:
                pipe.pexpire(self.key(digest), self.ttl_ms)  # a block in use is kept
        try:
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:  # as in check
            self._failed(exc)
            return []
        self._answered()
        if self.ttl_ms:
            replies = replies[::2]
        found: list[memoryview] = []
        for digest, reply in zip(digests, replies, strict=True):
            payload = self._verified(digest, reply)
            if payload is None:
                break
            found.append(payload)
        with self._lock:
            self.counters.num_fetched += len(found)
            self.counters.bytes_fetched += len(found) * self.value_bytes
        return found

    def _verified(self, digest: bytes, reply: object) -> memoryview | None:
        if isinstance(reply, redis.ResponseError) and str(reply).startswith("WRONGTYPE"):
            self._corrupt(digest, "a key of another type")
            return None
        if isinstance(reply, BaseException):
            self._failed(reply)
            return None
        if not isinstance(reply, bytes):
            self._corrupt(digest, "not a string")
            return None
        if not reply:  # GETRANGE of an absent key is empty, and no block is
            with self._lock:
                self.counters.num_missed += 1
            return None
        payload = checked_block(reply, self.identity, digest) if len(reply) == self.value_bytes else None
        if payload is None:
            self._corrupt(digest, f"{len(reply)} bytes that are not this engine's block for its key")
        return payload

    def _corrupt(self, digest: bytes, what: str) -> None:
        with self._lock:
            self.counters.num_corrupt += 1
            first, self._warned_corrupt = not self._warned_corrupt, True
        if first:
            log.warning(
                "kv remote tier: the value of %s in %s is %s: not loaded, deleted, its block computed (further "
                "ones are only counted: ovserve_kv_remote_corrupt_blocks_total)",
                self.key(digest).decode(),
                self.where,
                what,
            )
        try:
            self.client.delete(self.key(digest))
        except Exception as exc:  # as in check
            self._failed(exc)

    def publish(self, blocks: Sequence[tuple[bytes, bytes]]) -> bool:
        """Store blocks, (digest, payload) each, with their integrity headers, in one pipelined round trip. False
        when the store did not take them all (down, or refusing writes: one warning per episode)."""
        pipe = self.client.pipeline(transaction=False)
        for digest, payload in blocks:
            pipe.set(self.key(digest), block_header(self.identity, digest, payload) + payload, px=self.ttl_ms)
        try:
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:  # as in check
            self._failed(exc)
            return False
        self._answered()
        refused = [r for r in replies if isinstance(r, BaseException)]
        with self._lock:
            self.counters.num_published += len(blocks) - len(refused)
            self.counters.bytes_published += (len(blocks) - len(refused)) * self.value_bytes
            self.counters.num_errors += bool(refused)
            first, self._warned_refused = refused and not self._warned_refused, bool(refused)
        if first:
            log.warning(
                "kv remote tier: %s refuses writes (%s); blocks are not published until it takes them again "
                "(a full store: give it maxmemory-policy allkeys-lru)",
                self.where,
                refused[0],
            )
        return not refused

    def close(self) -> None:
        self.client.close()
