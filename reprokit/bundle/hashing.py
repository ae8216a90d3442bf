"""sha256 of files at disk speed, reading and hashing overlapped (a helper thread hashes piece *i* while piece
*i + 1* is read: ``hashlib`` and file reads both release the GIL), and the manifest's digest of itself. No torch
here: ``inspect`` and ``verify`` hash files without importing it.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

CHUNK = 32 << 20
"""Bytes per write/read call and per hashed piece: large enough for disk speed, small enough to overlap."""


def submit(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> Future[T]:
    """``pool.submit(fn, *args)``, or ``fn`` run here where the pool can take no work. Once the interpreter exits,
    ``concurrent.futures`` takes none (and Python 3.12+ starts no thread), yet a bundle may still be written then:
    the incident watcher finishing a peer's window at exit (:meth:`reprokit.distributed.IncidentBoard.finish`)."""
    try:
        return pool.submit(fn, *args)
    except RuntimeError:  # "cannot schedule new futures after interpreter shutdown", "can't create new thread"
        done: Future[T] = Future()
        done.set_result(fn(*args))
        return done


def open_regular(path: Path, *, follow_links: bool = False) -> io.FileIO:
    """``path`` opened for unbuffered reading, refused unless it is a regular file: a FIFO (opened without
    blocking, so a FIFO swapped into a bundle cannot hang a reader), a device, or (unless ``follow_links``) a
    symlink is an ``OSError``."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | (0 if follow_links else getattr(os, "O_NOFOLLOW", 0))
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return io.FileIO(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_hashed(path: Path, pieces: Iterator[memoryview], *, follow_links: bool = False) -> tuple[str, int]:
    """Read ``path`` (a regular file: :func:`open_regular`) into the buffers ``pieces`` yields, hashing piece i
    while piece i + 1 is read."""
    h = hashlib.sha256()
    total = 0
    with open_regular(path, follow_links=follow_links) as f, ThreadPoolExecutor(1, thread_name_prefix="reprokit-hash") as pool:
        pending: Future[None] | None = None
        for buf in pieces:
            n = 0
            while n < len(buf) and (k := f.readinto(buf[n:])):
                n += k
            if pending is not None:
                pending.result()
            if not n:
                break
            pending = submit(pool, h.update, buf[:n])
            total += n
            if n < len(buf):
                break
        if pending is not None:
            pending.result()
    return h.hexdigest(), total


def sha256_file(path: Path, chunk: int = CHUNK) -> str:
    """The sha256 of a file, reading and hashing overlapped (two buffers in turn).

    A file that fits in one chunk (JSON, code, most step files) is read and hashed in one go: two chunk-sized
    buffers and a hashing thread would cost more than the file. Links are followed (an archive the user names may
    be one); a FIFO or a device is an ``OSError``, never a hang.
    """
    with open_regular(path, follow_links=True) as f:
        if os.fstat(f.fileno()).st_size < chunk:
            data = f.read()  # to the end, whatever the size now (a file that grew is hashed as it is read)
            if len(data) < chunk:
                return hashlib.sha256(data).hexdigest()
    bufs = [memoryview(bytearray(chunk)), memoryview(bytearray(chunk))]

    def turns() -> Iterator[memoryview]:
        i = 0
        while True:
            yield bufs[i % 2]
            i += 1

    return read_hashed(path, turns(), follow_links=True)[0]


def sha256_many(paths: list[Path]) -> dict[Path, str | OSError]:
    """sha256 of every file, several at once (one file's hash is one sequential stream, so a bundle's
    files are spread over the cores, largest first); the ``OSError`` for a file that cannot be read (a FIFO
    or a device swapped in, permissions)."""
    def digest(p: Path) -> str | OSError:
        try:
            return sha256_file(p)
        except OSError as e:
            return e

    workers = min(len(paths), os.cpu_count() or 1, 8)
    if workers <= 1:
        return {p: digest(p) for p in paths}
    order = sorted(paths, key=lambda p: -p.stat().st_size)
    try:
        with ThreadPoolExecutor(workers, thread_name_prefix="reprokit-verify") as pool:
            return dict(zip(order, pool.map(digest, order)))
    except RuntimeError:  # the interpreter is exiting (see submit): the incident watcher checks a window then too
        return {p: digest(p) for p in paths}


def _self_digest(manifest: dict[str, Any]) -> str:
    """sha256 of the manifest's own content (minus this field), so edits to the manifest show too."""
    body = {k: v for k, v in manifest.items() if k != "self_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
