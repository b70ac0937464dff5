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

Nothing in the folder is trusted (cache volumes are shared between machines and restored from backups). The
store works through a handle on its own folder, opened without following a link, so every file it creates,
reads, renames or removes is in that folder, and a link put in the folder's place or under a block's name
leads nowhere. An entry under a block's name that is not a regular file it can read (a link, a folder, a pipe,
a socket, a device, a file it may not read) is one corrupt block: counted, warned about once, and removed
when that is safe (a link itself, never what it leads to; a pipe; an empty folder). A folder with anything
inside is never emptied: it stays, and its block is not stored. A server holds its folder with an exclusive
lock on a file in it (open(exclusive=True)), which the kernel drops when the process ends however it ends:
two servers in one folder would each keep it within their own bound, together beyond it, and each would
remove the other's writes in progress as leftovers of a crash.

Thread-safe: the engine thread asks what is stored; the tier's I/O thread reads, writes and evicts.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import socket
import stat
import struct
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
# A running server holds its folder with an exclusive flock on this file. Another server's start only checks the
# lock (a shared lock taken and dropped at once), so a start that meets such a check tries again for a while.
LOCK_NAME = "server.lock"
HOLD_ATTEMPTS = 20
HOLD_RETRY_SECONDS = 0.05


@dataclass
class Entry:
    size: int
    last_used: float  # time.time() of its write or last restore


@dataclass
class StoreCounters:
    num_written: int = 0
    num_read: int = 0
    num_evicted: int = 0
    # entries under a block's name never loaded: files truncated, corrupt or foreign, and anything but a regular
    # file it can read (each counted once)
    num_corrupt: int = 0
    bytes_written: int = 0
    bytes_read: int = 0


class FolderInUse(RuntimeError):
    """Another running server holds the store's folder: two servers in one folder would each keep it within
    their own bound, together beyond it, and each would remove the other's writes in progress."""


class DiskStore:
    def __init__(self, root: Path, identity: bytes, capacity_bytes: int, ttl_seconds: float = 0.0) -> None:
        if len(identity) != 32:
            raise ValueError("identity must be 32 bytes")
        self.identity = identity
        self.root = Path(root)
        self.folder = self.root / identity.hex()[:32]
        self.capacity_bytes = capacity_bytes
        self.ttl_seconds = ttl_seconds
        self.counters = StoreCounters()
        self._index: OrderedDict[bytes, Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        # the folder, opened without following a link: every file operation is made relative to it, so a link
        # put in its place later leads nowhere
        self._dir: int | None = None
        self._held: int | None = None  # the lock file, while this store holds the folder
        self._refused: set[bytes] = set()  # blocks whose name a folder holds that is not removed: never stored

    # -- start ---------------------------------------------------------------------------------------------
    def open(self, exclusive: bool = False) -> None:
        """Create the folder, prove it writable, and index what an earlier run left. With exclusive, hold the
        folder for this process first (FolderInUse when another holds it). Raises OSError when the folder
        cannot be used."""
        start = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)  # the operator's folder: it may itself be a link
        root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._dir = _own_folder(root, self.folder)
        finally:
            os.close(root)
        try:
            if exclusive:
                self._held = _hold(self._dir, self.folder)
            handle, probe = _temporary(self._dir)
            os.close(handle)
            os.unlink(probe, dir_fd=self._dir)
            found = self._scan(self._dir)
        except BaseException:
            self.close()
            raise
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

    def close(self) -> None:
        """Let go of the folder (and of its lock, if held)."""
        for handle in (self._held, self._dir):
            if handle is not None:
                os.close(handle)
        self._held = self._dir = None

    def _scan(self, folder: int) -> list[tuple[float, bytes, int]]:
        """The block files an earlier run left; temporary files of writes a crash cut short are removed, and
        anything else under a block's name is rejected."""
        found: list[tuple[float, bytes, int]] = []
        with os.scandir(folder) as listing:
            items = list(listing)
        for item in items:
            try:
                info = item.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed since the listing
                continue
            digest = _digest_of(item.name)
            if digest is None:
                if item.name.endswith(TEMP_SUFFIX) and not stat.S_ISDIR(info.st_mode):
                    _remove(folder, item.name)
            elif stat.S_ISREG(info.st_mode):
                found.append((info.st_mtime, digest, info.st_size))
            else:
                self._reject(digest, _kind(info.st_mode))
        return found

    def remove_abandoned_folders(self) -> None:
        """Remove the folders of other engine identities whose newest block is older than
        ABANDONED_AFTER_SECONDS (or the TTL, when shorter), unless a running server holds them. Only the
        tier's own files are removed, and the folder itself if nothing else is inside; no link is followed."""
        horizon = time.time() - min(ABANDONED_AFTER_SECONDS, self.ttl_seconds or ABANDONED_AFTER_SECONDS)
        with contextlib.suppress(OSError):
            root = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                for name in os.listdir(root):
                    if name != self.folder.name and IDENTITY_FOLDER.fullmatch(name):
                        with contextlib.suppress(OSError):
                            self._remove_if_abandoned(root, name, horizon)
            finally:
                os.close(root)

    def _remove_if_abandoned(self, root: int, name: str, horizon: float) -> None:
        folder = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
        try:
            if _is_held(folder):
                return
            files = [f for f in os.listdir(folder) if _digest_of(f) or f.endswith(TEMP_SUFFIX) or f == LOCK_NAME]
            times = [os.fstat(folder).st_mtime] + [
                os.stat(f, dir_fd=folder, follow_symlinks=False).st_mtime for f in files
            ]
            # the folder's own time covers one just created, and files just written or removed
            if max(times) >= horizon:
                return
            for f in files:
                _remove(folder, f)
        finally:
            os.close(folder)
        os.rmdir(name, dir_fd=root)  # fails, and so keeps it, if anything else is inside (or it is a link now)
        log.info(
            "kv disk tier: removed %s: no block of it used for %.0f h",
            self.root / name,
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
        """Store one block, making room first. Raises OSError when the disk refuses (full, read-only). A block
        whose name a folder holds that could not be removed is not stored."""
        size = HEADER.size + len(payload)
        if digest in self or digest in self._refused or size > self.capacity_bytes:
            return
        self.evict(size)
        folder = self._fd()
        header = block_header(self.identity, digest, payload)
        handle, temp = _temporary(folder)
        try:
            with os.fdopen(handle, "wb") as f:
                f.write(header)
                f.write(payload)
            placed = self._place(folder, temp, digest)
        except OSError:
            _remove(folder, temp)
            raise
        if not placed:
            return
        with self._lock:
            self._forget_locked(digest)  # an expired entry not yet swept
            self._index[digest] = Entry(size, time.time())
            self._bytes += size
            self.counters.num_written += 1
            self.counters.bytes_written += size

    def _place(self, folder: int, temp: str, digest: bytes) -> bool:
        """Rename a written file to its block's name. A rename replaces any entry but a folder (and never follows
        a link): a folder in the way is rejected first. False when it stays (the written file is removed)."""
        name = _name(digest)
        try:
            os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
            return True
        except IsADirectoryError:
            if not self._reject(digest, "a folder"):
                _remove(folder, temp)
                return False
        os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
        return True

    def read(self, digest: bytes, payload_bytes: int) -> memoryview | None:
        """The payload of a stored block, or None when it is missing or not exactly what was written for
        this digest by this engine identity (then the file is removed). Only a regular file of a block's size
        (payload_bytes and the header) is read: its name could have been given to a symlink, a pipe whose read
        never returns, or a file of any size; anything but a regular file it can read is rejected."""
        folder, name = self._fd(), _name(digest)
        if digest in self._refused:  # rejected already: one warning for it
            return None
        try:
            data = _read_regular(folder, name, HEADER.size + payload_bytes)
        except FileNotFoundError:
            self._forget(digest)
            return None
        except _NotABlockFile as odd:
            self._reject(digest, odd.what)
            return None
        except OSError as exc:
            # the disk's trouble, not the file's: the file stays (the caller stops the restore), and unless
            # it may pass (out of file handles) the block is forgotten, so it is not asked for again and again
            if exc.errno not in TRANSIENT_ERRORS:
                self._forget(digest)
            raise
        payload = None if data is None else checked_block(data, self.identity, digest)
        if payload is None:
            log.warning("kv disk tier: removing %s: truncated, corrupt or written by another engine", name)
            _remove(folder, name)
            self._forget(digest)
            self.counters.num_corrupt += 1
            return None
        now = time.time()
        with contextlib.suppress(OSError):
            os.utime(name, (now, now), dir_fd=folder, follow_symlinks=False)  # recency that survives a restart
        with self._lock:
            entry = self._index.get(digest)
            if entry is not None:
                entry.last_used = now
                self._index.move_to_end(digest)
            self.counters.num_read += 1
            self.counters.bytes_read += HEADER.size + len(payload)
        return payload

    def _reject(self, digest: bytes, what: str) -> bool:
        """Something under a block's name that is not a file of this store (what it is): one corrupt block,
        with one warning. It is removed if that is safe (see _remove); a folder that stays keeps its block from
        being stored, so it is not met again. True when it was removed."""
        name = _name(digest)
        removed = self._dir is not None and _remove(self._dir, name)
        self._forget(digest)
        if not removed:
            self._refused.add(digest)
        self.counters.num_corrupt += 1
        log.warning(
            "kv disk tier: %s in %s is %s, not a block file: counted as corrupt, %s",
            name,
            self.folder,
            what,
            "removed" if removed else "left in place (that block will not be stored)",
        )
        return removed

    def evict(self, room: int) -> None:
        """Remove expired blocks, then least recently used ones until room more bytes fit."""
        folder = self._fd()
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
            _remove(folder, _name(digest))

    def _forget(self, digest: bytes) -> None:
        with self._lock:
            self._forget_locked(digest)

    def _forget_locked(self, digest: bytes) -> None:
        entry = self._index.pop(digest, None)
        if entry is not None:
            self._bytes -= entry.size

    def _fd(self) -> int:
        if self._dir is None:
            raise OSError(errno.EBADF, "the disk store is not open", str(self.folder))
        return self._dir


def block_header(identity: bytes, digest: bytes, payload: bytes | memoryview) -> bytes:
    """The integrity header stored in front of a block's payload, on disk and in the remote tier alike."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, identity, digest, len(payload), zlib.crc32(payload))


def checked_block(data: bytes, identity: bytes, digest: bytes) -> memoryview | None:
    """The payload of a stored block (header and payload) if it is exactly what block_header described for this
    digest and engine identity: magic, version, identity, digest, length and CRC-32 all match. None otherwise."""
    if len(data) < HEADER.size:
        return None
    magic, version, stored_identity, stored_digest, length, crc = HEADER.unpack_from(data)
    payload = memoryview(data)[HEADER.size :]
    if (magic, version, stored_identity, stored_digest) != (MAGIC, FORMAT_VERSION, identity, digest):
        return None
    if len(payload) != length or zlib.crc32(payload) != crc:
        return None
    return payload


class _NotABlockFile(Exception):
    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


def _name(digest: bytes) -> str:
    return digest.hex() + SUFFIX


def _digest_of(name: str) -> bytes | None:
    """The digest a block file's name spells, exactly as _name writes it; None for any other name."""
    return bytes.fromhex(name[:64]) if BLOCK_NAME.fullmatch(name) else None


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a pipe"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    )
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def _read_regular(folder: int, name: str, size: int) -> bytes | None:
    """The bytes of folder's entry name if it is a regular file of exactly size bytes, else None; raises
    _NotABlockFile for anything but a regular file it can read. Never follows a symlink, never opens anything
    but a regular file (opening a device or a pipe may do something of its own), and never waits on a pipe
    put in its place meanwhile (O_NONBLOCK: opening one with no writer returns at once)."""
    mode = os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode
    if not stat.S_ISREG(mode):
        raise _NotABlockFile(_kind(mode))
    try:
        handle = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _NotABlockFile("a symlink") from None
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise _NotABlockFile(f"a file it cannot read ({exc.strerror})") from None
        raise
    try:
        info = os.fstat(handle)
        if not stat.S_ISREG(info.st_mode):
            raise _NotABlockFile(_kind(info.st_mode))
        if info.st_size != size:
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


def _remove(folder: int, name: str) -> bool:
    """Remove one entry of folder without following it: a file, a link (never what it leads to), a pipe, or
    an empty folder. A folder with anything inside stays: it is never emptied, since it may hold anything and
    lead anywhere. True when the entry is gone."""
    try:
        os.unlink(name, dir_fd=folder)
    except FileNotFoundError:
        pass
    except IsADirectoryError:
        try:
            os.rmdir(name, dir_fd=folder)
        except FileNotFoundError:
            pass
        except OSError:
            return False
    except OSError:
        return False
    return True


def _temporary(folder: int) -> tuple[int, str]:
    """A new file in folder, for a write to rename: its name was never an entry (O_EXCL), so nothing is
    followed or overwritten."""
    name = secrets.token_hex(8) + TEMP_SUFFIX
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(name, flags, 0o600, dir_fd=folder), name


def _own_folder(root: int, folder: Path) -> int:
    """The identity folder in root, created if missing and opened without following a link. An entry of its
    name that is not a folder (a symlink to another folder, a file) is removed, never followed, and replaced."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder.name, 0o700, dir_fd=root)  # users' text: the server's eyes only
    try:
        return os.open(folder.name, flags, dir_fd=root)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
    what = _kind(os.stat(folder.name, dir_fd=root, follow_symlinks=False).st_mode)
    log.warning("kv disk tier: %s was %s, not a folder: replaced by a new folder (not followed)", folder, what)
    os.unlink(folder.name, dir_fd=root)
    os.mkdir(folder.name, 0o700, dir_fd=root)
    return os.open(folder.name, flags, dir_fd=root)


def _hold(folder: int, path: Path) -> int:
    """Hold the folder for this process: an exclusive lock on its lock file, which the kernel drops when the
    process ends, however it ends. Raises FolderInUse when another process holds it."""
    holder = "unknown"
    for _ in range(HOLD_ATTEMPTS):
        handle = _lock_file(folder, path)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(handle)
            os.close(handle)
            time.sleep(HOLD_RETRY_SECONDS)
            continue
        os.ftruncate(handle, 0)
        os.pwrite(handle, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        return handle
    raise FolderInUse(
        f"{path} is held by another running server ({holder}): a folder under --kv-disk-dir belongs to one "
        f"server of a model and settings; give each server its own --kv-disk-dir"
    )


def _lock_file(folder: int, path: Path) -> int:
    """The folder's lock file, opened (created if missing) without following a link; anything else under its
    name is removed first."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        handle = os.open(LOCK_NAME, flags, 0o600, dir_fd=folder)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        what = "a symlink" if exc.errno == errno.ELOOP else "a folder" if exc.errno == errno.EISDIR else "a socket"
    else:
        mode = os.fstat(handle).st_mode
        if stat.S_ISREG(mode):
            return handle
        os.close(handle)
        what = _kind(mode)
    log.warning("kv disk tier: %s in %s was %s, not a file: replaced", LOCK_NAME, path, what)
    if not _remove(folder, LOCK_NAME):
        raise OSError(errno.EEXIST, f"{LOCK_NAME} is {what} and cannot be removed", str(path))
    return os.open(LOCK_NAME, flags | os.O_EXCL, 0o600, dir_fd=folder)


def _holder(handle: int) -> str:
    """Who holds a lock file, as its holder wrote it (only printable characters: it is the folder's text)."""
    with contextlib.suppress(OSError):
        text = os.pread(handle, 200, 0).decode("utf-8", "replace")
        return "".join(c for c in text if c.isprintable()).strip()[:100] or "unknown"
    return "unknown"


def _is_held(folder: int) -> bool:
    """Whether a running server holds folder. The check takes a shared lock and drops it at once: a server
    starting meanwhile tries again (HOLD_ATTEMPTS)."""
    try:
        handle = os.open(LOCK_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    except OSError:
        return False  # missing, or not a file: no server holds a lock through it
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            return False
        fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False  # the lock is dropped as the file is closed
    except BlockingIOError:
        return True
    finally:
        os.close(handle)
