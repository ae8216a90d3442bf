"""A gzip stream written as independent members, compressed on several threads, only where compression pays.

``reprokit pack -o repro.tar.gz`` used one ``gzip.GzipFile`` at level 6: one core deflating a stream that is
almost all float tensors, which deflate shrinks by about 7% (float32, float16; bfloat16 about 20%), at 20-30 MB/s.
:class:`GzipMembers` cuts the tar stream into blocks of :data:`BLOCK` bytes and writes each as a gzip member of its
own (RFC 1952: a gzip file is a series of members; ``gzip``, ``tar xzf``, Python's ``gzip`` and ``tarfile`` read
them all as one stream). The blocks are compressed on a thread pool (zlib and crc32 release the GIL) and written in
order, so the output depends on the input bytes alone, never on the number of threads or the sizes of the writes.

Each block is first judged on a sample (:func:`level_for`): where deflate saves less than :data:`MIN_SAVING` the
block is written as *stored* deflate blocks (the bytes as they are, framed: a copy and a crc32), where it saves a
little it is deflated at level 1, where it saves much at level 6 (gzip's default, what pack wrote before).
Float32/float16 tensors are stored, bfloat16 tensors deflated at level 1, JSON, code and token ids at level 6.
So an archive of a float32 state is about 7% larger than one deflated throughout and is written at close to the
speed of a plain ``.tar``, while what compresses well is as small as before.

Example:
    >>> import gzip, io
    >>> buf = io.BytesIO()
    >>> with GzipMembers(buf, block=4096) as gz:
    ...     _ = gz.write(b"abc" * 5000)
    >>> gzip.decompress(buf.getvalue()) == b"abc" * 5000
    True
"""

from __future__ import annotations

import collections
import io
import os
import struct
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

BLOCK = 1 << 20
"""Input bytes per gzip member. Deflate's window is 32 KiB, so members of a MiB compress as well as one stream
(within 0.1% of the input, on reprokit's own source and on int64 token ids); each adds 18 bytes of header and
trailer."""
MIN_SAVING = 0.10
"""The least fraction of a block deflate (level 1) must save on its sample for the block to be compressed.
Float32 and float16 weights save about 7%, at an order of magnitude more time than storing them: they are
stored. bfloat16 (about 20%), int64 token ids (about 60%), JSON and code (65-85%) are compressed."""
MUCH_SAVING = 0.40
"""From this saving on, a block is deflated at level 6 rather than 1: on Python source level 6 leaves 18% fewer
bytes than level 1 (0.29 of the input against 0.36), on int64 token ids 5%; on bfloat16 weights, which save less,
0.9%, at about 3 times the time."""
SAMPLE = 16 << 10
"""Bytes deflated from each of two places in a block to judge it (a quarter and three quarters in)."""
MAX_THREADS = 16
"""Most compressing threads: past that the archive's sha256 and the disk are the limit (stored blocks are a copy),
and the blocks in flight (two per thread) stay under 64 MiB."""
_STORED_MAX = 0xFFFF
"""Most bytes in one stored deflate block (RFC 1951, 3.2.4)."""


class Writable(Protocol):
    """Where members go: a binary file, or anything with its ``write`` (``None``: everything was written)."""

    def write(self, data: Any, /) -> int | None: ...


def level_for(block: bytes | memoryview) -> int:
    """The deflate level for ``block``, by the fraction of it deflate (level 1) saves on two samples (a quarter and
    three quarters in; the whole block when it is small): 0 (stored) under :data:`MIN_SAVING`, 6 from
    :data:`MUCH_SAVING` on, 1 between."""
    n = len(block)
    if n <= 4 * SAMPLE:
        sample = bytes(block)
    else:
        sample = bytes(block[n // 4:n // 4 + SAMPLE]) + bytes(block[3 * n // 4:3 * n // 4 + SAMPLE])
    if not sample:
        return 0
    saving = 1 - len(_deflate(sample, 1)) / len(sample)
    return 0 if saving < MIN_SAVING else 6 if saving >= MUCH_SAVING else 1


def member(block: bytes | memoryview, level: int | None = None) -> bytes:
    """One gzip member holding ``block``, deflated at ``level`` (default: :func:`level_for` the block; 0: stored).
    Where deflate would come out larger than the bytes themselves, they are stored.

    The header is fixed (no name, mtime 0, OS 255 "unknown"), as ``gzip.GzipFile(mtime=0)`` writes it.
    """
    n = len(block)
    trailer = struct.pack("<II", zlib.crc32(block), n & 0xFFFFFFFF)
    level = level_for(block) if level is None else level
    body = _deflate(block, level) if level else None
    if body is None or len(body) >= n + 5 * max(1, -(-n // _STORED_MAX)):  # stored is smaller: store
        return b"".join([_header(0), *_stored(block), trailer])  # one copy of the bytes, framed
    return b"".join([_header({1: 4, 9: 2}.get(level, 0)), body, trailer])  # gzip's flags for levels 1 and 9


def _header(xfl: int) -> bytes:
    return b"\x1f\x8b\x08\x00\x00\x00\x00\x00" + bytes((xfl, 255))


def _deflate(data: bytes | memoryview, level: int) -> bytes:
    c = zlib.compressobj(level, zlib.DEFLATED, -15)  # raw deflate: the gzip framing is ours
    return c.compress(data) + c.flush()


def _stored(data: bytes | memoryview) -> list[bytes | memoryview]:
    """``data`` as stored deflate blocks (a byte of block type, the length and its complement, the bytes), in pieces
    to join. Framed here rather than by zlib's level 0, so the framing is the same with every zlib build."""
    view = memoryview(data)
    parts: list[bytes | memoryview] = []
    for start in range(0, max(len(view), 1), _STORED_MAX):
        chunk = view[start:start + _STORED_MAX]
        last = start + _STORED_MAX >= len(view)
        parts += [struct.pack("<BHH", 1 if last else 0, len(chunk), len(chunk) ^ 0xFFFF), chunk]
    return parts


def threads() -> int:
    """Threads to compress with: the cores this process may run on, at most :data:`MAX_THREADS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_THREADS))


class GzipMembers(io.RawIOBase):
    """A writable gzip stream: ``block`` bytes (default :data:`BLOCK`) per member (:func:`member`, at ``level``:
    by default chosen per block), compressed on ``workers`` threads (default: every core this process may use) and
    written to ``out`` in order.

    At most ``2 * workers`` blocks are in flight, so memory stays at a few MiB per thread. An error from
    ``out.write`` or from a worker is raised by the next :meth:`write` or by :meth:`close`. Closing writes the
    last (short) block; it does not close ``out``.
    """

    def __init__(self, out: Writable, *, level: int | None = None, block: int | None = None, workers: int | None = None):
        block = BLOCK if block is None else block
        if block <= 0:
            raise ValueError(f"block must be positive, got {block}")
        self._out, self._level, self._block = out, level, block
        self._workers = max(1, workers or threads())
        self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="reprokit-gzip")
        self._pending: collections.deque[Future[bytes]] = collections.deque()
        self._buf = bytearray()
        self.n = 0

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        """Input bytes written so far (what ``tarfile`` asks of the file it writes)."""
        return self.n

    def write(self, data: Any) -> int:
        if self.closed:
            raise ValueError("write to a closed GzipMembers")
        view = memoryview(data).cast("B")
        size = len(view)
        if self._buf:  # top up the partial block first
            take = min(len(view), self._block - len(self._buf))
            self._buf += view[:take]
            view = view[take:]
            if len(self._buf) == self._block:
                self._submit(bytes(self._buf))
                self._buf.clear()
        while len(view) >= self._block:  # whole blocks straight from the caller's buffer
            block = view[:self._block]
            self._submit(block if isinstance(data, bytes) else bytes(block))  # bytes never change; others may
            view = view[self._block:]
        self._buf += view
        self.n += size
        return size

    def _submit(self, block: bytes | memoryview) -> None:
        self._pending.append(self._pool.submit(member, block, self._level))
        while self._pending and (len(self._pending) > 2 * self._workers or self._pending[0].done()):
            self._write_out(self._pending.popleft().result())

    def _write_out(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            written = self._out.write(view)
            view = view[len(view) if written is None else written:]  # None: a file that writes all or raises

    def close(self) -> None:
        """Compress what is buffered, write every member in order, stop the threads."""
        if self.closed:
            return
        try:
            if self._buf or self.n == 0:  # an empty stream is still one (empty) member: a valid gzip file
                self._submit(bytes(self._buf))
                self._buf.clear()
            while self._pending:
                self._write_out(self._pending.popleft().result())
        finally:
            self.discard()

    def discard(self) -> None:
        """Stop without writing what is still buffered or in flight (the output is being thrown away)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending.clear()
        self._buf.clear()
        super().close()

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        """On an error, :meth:`discard` (writing the rest would be wasted, and could raise over the error)."""
        self.discard() if exc_type is not None else self.close()
