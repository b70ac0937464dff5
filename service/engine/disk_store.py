"""Files of KV blocks on a local disk: one file per block, named by the block's chained digest.

A file holds a header (format version, the engine's identity, the block's digest, the payload's length
and CRC-32) and the payload: the block's bytes of every layer's key and value cache, exactly as the
compiled model stores them. Files are written to a temporary name and renamed, so a reader never sees
half a file; a file whose header or checksum does not match what was asked for is removed, never
loaded. Files live in a folder named after the engine's identity, so engines of different models or
settings can share a disk without touching each other's blocks.

The store is bounded by size (least recently used out) and, optionally, by idle time. Its index is
rebuilt from the folder listing at start (names, sizes, modification times; no file is read), and a
restore refreshes a file's modification time, so recency survives restarts.

Thread-safe: the engine thread asks what is stored; the tier's I/O thread reads, writes and evicts.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import stat
import struct
import tempfile
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"OVKVBLK\0"
FORMAT_VERSION = 1
# magic, version, identity (32 bytes), digest (32 bytes), payload length, payload CRC-32
HEADER = struct.Struct("<8sI32s32sQI")
SUFFIX = ".kvb"
TRANSIENT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.EINTR, errno.ENOMEM)
TEMP_SUFFIX = ".tmp"
BLOCK_NAME = re.compile(r"[0-9a-f]{64}\.kvb")
IDENTITY_FOLDER = re.compile(r"[0-9a-f]{32}")
# A folder of another engine identity (an older model or settings) that nothing has written or restored
# from for this long is removed at start, so that upgrades do not fill the disk with blocks no engine can use.
ABANDONED_AFTER_SECONDS = 7 * 24 * 3600


@dataclass
class Entry:
    size: int
    last_used: float  # time.time() of its write or last restore


@dataclass
class StoreCounters:
    num_written: int = 0
    num_read: int = 0
    num_evicted: int = 0
    num_corrupt: int = 0  # files removed because they were truncated, corrupt or foreign
    bytes_written: int = 0
    bytes_read: int = 0


class DiskStore:
    def __init__(self, root: Path, identity: bytes, capacity_bytes: int, ttl_seconds: float = 0.0) -> None:
        if len(identity) != 32:
            raise ValueError("identity must be 32 bytes")
        self.identity = identity
        self.folder = Path(root) / identity.hex()[:32]
        self.capacity_bytes = capacity_bytes
        self.ttl_seconds = ttl_seconds
        self.counters = StoreCounters()
        self._index: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()

    # -- start ---------------------------------------------------------------------------------------------
    def open(self) -> None:
        """Create the folder, prove it writable, and index what an earlier run left. Raises OSError when
        the folder cannot be used."""
        start = time.perf_counter()
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # users' text: the server's eyes only
        handle, probe = tempfile.mkstemp(suffix=TEMP_SUFFIX, dir=self.folder)
        os.close(handle)
        os.unlink(probe)
        found: list[tuple[float, bytes, int]] = []
        with os.scandir(self.folder) as listing:
            for item in listing:
                digest = _digest_of(item.name)
                if digest is None or not item.is_file(follow_symlinks=False):
                    if item.name.endswith(TEMP_SUFFIX):  # a write cut short by a crash
                        _remove(Path(item.path))
                    continue
                stat = item.stat(follow_symlinks=False)
                found.append((stat.st_mtime, digest, stat.st_size))
        with self._lock:
            for mtime, digest, size in sorted(found):
                self._index[digest] = Entry(size, mtime)
                self._bytes += size
        self.evict(0)
        self.remove_abandoned_folders()
        log.info(
            "kv disk tier: %d blocks (%.1f MiB) found in %s in %.3f s",
            len(self._index),
            self._bytes / 2**20,
            self.folder,
            time.perf_counter() - start,
        )

    def remove_abandoned_folders(self) -> None:
        """Remove the folders of other engine identities whose newest block is older than
        ABANDONED_AFTER_SECONDS (or the TTL, when shorter). A folder an engine still uses has recent files."""
        horizon = time.time() - min(ABANDONED_AFTER_SECONDS, self.ttl_seconds or ABANDONED_AFTER_SECONDS)
        for folder in self.folder.parent.iterdir():
            if folder == self.folder or not IDENTITY_FOLDER.fullmatch(folder.name) or folder.is_symlink():
                continue
            with contextlib.suppress(OSError):
                files = [f for f in folder.iterdir() if _digest_of(f.name) or f.name.endswith(TEMP_SUFFIX)]
                # the folder's own time covers one just created, and files just written or removed
                if all(f.lstat().st_mtime < horizon for f in [folder, *files]):
                    for f in files:
                        _remove(f)
                    folder.rmdir()  # fails, and so keeps it, if anything else is inside
                    log.info(
                        "kv disk tier: removed %s: no block of it used for %.0f h",
                        folder,
                        (time.time() - horizon) / 3600,
                    )

    # -- queries -----------------------------------------------------------------------------------------
    def __contains__(self, digest: bytes) -> bool:
        with self._lock:
            return self._live(digest) is not None

    def count_chain(self, digests: Sequence[bytes]) -> int:
        """How many of digests, from the first on, are stored."""
        with self._lock:
            for i, digest in enumerate(digests):
                if self._live(digest) is None:
                    return i
            return len(digests)

    def touch(self, digests: Sequence[bytes]) -> None:
        """Mark a chain's blocks used now, the last first, so that the chain's head goes last."""
        now = time.time()
        with self._lock:
            for digest in reversed(digests):
                entry = self._index.get(digest)
                if entry is not None:
                    entry.last_used = now
                    self._index.move_to_end(digest)

    @property
    def num_blocks(self) -> int:
        return len(self._index)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def _live(self, digest: bytes) -> Entry | None:
        entry = self._index.get(digest)
        if entry is not None and self.ttl_seconds and time.time() - entry.last_used > self.ttl_seconds:
            return None  # expired: the next eviction removes it
        return entry

    # -- files -------------------------------------------------------------------------------------------
    def write(self, digest: bytes, payload: bytes | memoryview) -> None:
        """Store one block, making room first. Raises OSError when the disk refuses (full, read-only)."""
        size = HEADER.size + len(payload)
        if digest in self or size > self.capacity_bytes:
            return
        self.evict(size)
        path = self._path(digest)
        header = HEADER.pack(MAGIC, FORMAT_VERSION, self.identity, digest, len(payload), zlib.crc32(payload))
        handle, temp = tempfile.mkstemp(suffix=TEMP_SUFFIX, dir=self.folder)
        try:
            with os.fdopen(handle, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(temp, path)
        except OSError:
            _remove(Path(temp))
            raise
        with self._lock:
            self._forget_locked(digest)  # an expired entry not yet swept
            self._index[digest] = Entry(size, time.time())
            self._bytes += size
            self.counters.num_written += 1
            self.counters.bytes_written += size

    def read(self, digest: bytes, payload_bytes: int) -> memoryview | None:
        """The payload of a stored block, or None when it is missing or not exactly what was written for
        this digest by this engine identity (then the file is removed). Only a regular file of a block's size
        (payload_bytes and the header) is read: its name could have been given to a symlink, a pipe whose read
        never returns, or a file of any size."""
        path = self._path(digest)
        try:
            data = _read_regular(path, HEADER.size + payload_bytes)
        except FileNotFoundError:
            self._forget(digest)
            return None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                # the disk's trouble, not the file's: the file stays (the caller stops the restore), and unless
                # it may pass (out of file handles) the block is forgotten, so it is not asked for again and again
                if exc.errno not in TRANSIENT_ERRORS:
                    self._forget(digest)
                raise
            data = None  # a symlink (O_NOFOLLOW): not this store's block
        payload = None if data is None else self._check(data, digest)
        if payload is None:
            log.warning("kv disk tier: removing %s: truncated, corrupt or written by another engine", path.name)
            _remove(path, folder_too=True)
            self._forget(digest)
            self.counters.num_corrupt += 1
            return None
        now = time.time()
        with contextlib.suppress(OSError):
            os.utime(path, (now, now))  # recency that survives a restart
        with self._lock:
            entry = self._index.get(digest)
            if entry is not None:
                entry.last_used = now
                self._index.move_to_end(digest)
            self.counters.num_read += 1
            self.counters.bytes_read += HEADER.size + len(payload)
        return payload

    def _check(self, data: bytes, digest: bytes) -> memoryview | None:
        if len(data) < HEADER.size:
            return None
        magic, version, identity, stored_digest, length, crc = HEADER.unpack_from(data)
        payload = memoryview(data)[HEADER.size :]
        if (magic, version, identity, stored_digest) != (MAGIC, FORMAT_VERSION, self.identity, digest):
            return None
        if len(payload) != length or zlib.crc32(payload) != crc:
            return None
        return payload

    def evict(self, room: int) -> None:
        """Remove expired blocks, then least recently used ones until room more bytes fit."""
        doomed: list[bytes] = []
        horizon = time.time() - self.ttl_seconds if self.ttl_seconds else -1.0
        with self._lock:
            # the index is in order of last use, so expired blocks come first
            while self._index and (
                self._bytes + room > self.capacity_bytes or next(iter(self._index.values())).last_used < horizon
            ):
                digest, entry = self._index.popitem(last=False)
                self._bytes -= entry.size
                doomed.append(digest)
            self.counters.num_evicted += len(doomed)
        for digest in doomed:
            _remove(self._path(digest))

    def _forget(self, digest: bytes) -> None:
        with self._lock:
            self._forget_locked(digest)

    def _forget_locked(self, digest: bytes) -> None:
        entry = self._index.pop(digest, None)
        if entry is not None:
            self._bytes -= entry.size

    def _path(self, digest: bytes) -> Path:
        return self.folder / (digest.hex() + SUFFIX)


def _digest_of(name: str) -> bytes | None:
    """The digest a block file's name spells, exactly as _path writes it; None for any other name."""
    return bytes.fromhex(name[:64]) if BLOCK_NAME.fullmatch(name) else None


def _read_regular(path: Path, size: int) -> bytes | None:
    """The file's bytes if it is a regular file of exactly size bytes, else None; never follows a symlink and
    never waits on a pipe (O_NONBLOCK: opening one with no writer returns at once)."""
    handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode) or info.st_size != size:
            return None
        chunks, left = [], size
        while left > 0:
            chunk = os.read(handle, left)
            if not chunk:  # shrank while read
                return None
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(handle)


def _remove(path: Path, folder_too: bool = False) -> None:
    """Remove a file; with folder_too, also a folder under a block's name (inside the store's own folder), which
    a later write of that block could not replace."""
    try:
        path.unlink()
    except IsADirectoryError:
        if folder_too:
            shutil.rmtree(path, ignore_errors=True)
    except OSError:
        pass
