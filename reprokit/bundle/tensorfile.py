"""The one tensor writer and reader: safetensors files streamed at disk speed, hashed on the way.

Every file reprokit writes tensors to goes through :func:`write_safetensors` (bundle files and the
recorder's spill file): the header, then each tensor's bytes straight from its own memory (a CUDA
tensor through a bounded staging buffer), never a second copy of the state in host memory. The
sha256 of what is written runs in a helper thread while the next piece is written (``hashlib``
and file writes both release the GIL), so a dump costs max(write, hash), not their sum.

:func:`read_verified` reads a whole file into one buffer and hashes it in the same pass (the
hash of piece *i* runs while piece *i + 1* is read); tensors are made from that buffer only after
its digest matched the manifest's. Nothing is unpickled; the header is parsed as strict JSON and
every range is checked against the buffer before a view is taken.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from reprokit.bundle import schema
from reprokit.bundle.hashing import CHUNK, read_hashed, submit

_SMALL = 1 << 20  # pieces below this are hashed inline (a thread hand-off costs more than it saves)
SHARD_BYTES = 256 << 20
"""Most bytes of tensors per file of a large state (a tensor larger than this gets a file of its own).

One file's sha256 is one sequential stream, about as fast as one disk, so a state in one file is written and
read at most at one core's hash rate. Split in files of this size, several are written, read and hashed at
once (:func:`parallelism`), and the layout depends only on the state, never on the machine."""

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("float8_e8m0fnu", "F8_E8M0"),
                     ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("complex64", "C64")):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = _code
BY_CODE = {code: dtype for dtype, code in DTYPES.items()}

Staging = Callable[[int], torch.Tensor]
"""``staging(n)``: a host uint8 buffer of ``n`` bytes to copy a device tensor's piece through."""


@dataclass(frozen=True)
class WrittenFile:
    """A tensor file written earlier (a spilled snapshot) with the sha256 and size computed as it was written."""

    path: Path
    sha256: str
    size: int


def shard(tensors: dict[str, torch.Tensor], shard_bytes: int | None = None) -> list[dict[str, torch.Tensor]]:
    """``tensors`` split in key order into groups of at most ``shard_bytes`` (default :data:`SHARD_BYTES`; one
    larger tensor stays whole) and at most :data:`reprokit.bundle.schema.MAX_TENSORS` tensors (what a reader accepts in
    one file); always at least one group (an empty state is one empty file)."""
    shard_bytes = SHARD_BYTES if shard_bytes is None else shard_bytes
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in sorted(tensors.items()):
        n = t.numel() * t.element_size()
        if groups[-1] and (size + n > shard_bytes or len(groups[-1]) >= schema.MAX_TENSORS):
            groups.append({})
            size = 0
        groups[-1][key] = t
        size += n
    return groups


def parallelism(files: int) -> int:
    """Files to write or read at once: each uses two threads (I/O and hashing), so half the usable cores,
    at most 8 (past that the disk, not the hashing, is the limit)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(files, cores // 2, 8))


class TensorFileError(ValueError):
    """A tensor file that does not match its digest or its own header (callers wrap it in a BundleError)."""


def _header(tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    items = sorted(tensors.items())
    header: dict[str, Any] = {}
    offset = 0
    for key, t in items:
        if t.dtype not in DTYPES:
            raise TypeError(f"{key}: dtype {t.dtype} cannot be stored in safetensors")
        n = t.numel() * t.element_size()
        header[key] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, items


def _pieces(items: list[tuple[str, torch.Tensor]], staging: Staging | None, chunk: int) -> Iterator[memoryview]:
    for _, t in items:
        if not t.numel():
            continue
        flat = t.detach()
        if not flat.is_contiguous():
            flat = flat.contiguous()  # this one tensor only (a view of a batch, a transposed weight)
        flat = flat.reshape(-1).view(torch.uint8)
        for a in range(0, flat.numel(), chunk):
            part = flat[a:a + chunk]
            if part.device.type != "cpu":
                if staging is None:
                    part = part.cpu()
                else:
                    buf = staging(part.numel())
                    buf.copy_(part)
                    part = buf
            yield memoryview(cast(Any, part.numpy())).cast("B")


def safetensors_parts(tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    """The bytes of a safetensors file of these host tensors (header, then each tensor in key order), as buffers
    over the tensors' own memory: nothing is copied but a non-contiguous tensor. For ``os.writev`` and an
    incremental hash; ``b"".join`` of them is what ``safetensors.torch.save`` would load back.

    Raises:
        TypeError: for a dtype safetensors cannot store.
    """
    head, items = _header(tensors)
    parts = [memoryview(head)]
    for key, t in items:
        view = _host_bytes(t)
        if view is None:
            parts.extend(_pieces([(key, t)], None, CHUNK))
        elif len(view):
            parts.append(view)
    return parts


def _host_bytes(t: torch.Tensor) -> memoryview | None:
    """The bytes of a contiguous host tensor of a dtype numpy has, through one numpy view (a record is written per
    training step: the general path costs several tensor operations per tensor); None otherwise."""
    if t.device.type != "cpu" or t.dim() == 0 or not t.is_contiguous() or t.requires_grad:
        return None
    try:
        return memoryview(cast(Any, t.numpy())).cast("B")
    except (TypeError, RuntimeError, ValueError):  # bfloat16, float8 (no numpy dtype), a conjugate view
        return None


def _write_all(f: BinaryIO, data: memoryview) -> None:
    while data:
        n = f.write(data)
        data = data[n:]


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], *, staging: Staging | None = None,
                      chunk: int = CHUNK) -> tuple[str, int]:
    """Write ``tensors`` as a safetensors file at ``path`` (fsynced); returns ``(sha256, size)``.

    Tensors are written in key order straight from their memory, ``chunk`` bytes at a time; device
    tensors go through ``staging`` (else ``.cpu()`` per piece). Tensors may share storage.

    Raises:
        TypeError: for a dtype safetensors cannot store.
        OSError: from the filesystem (``FileNotFoundError`` when the folder vanished).

    Example:
        >>> write_safetensors(Path("x.safetensors"), {"w": torch.ones(2)})   # doctest: +SKIP
        ('b3f1...', 80)
    """
    head, items = _header(tensors)
    h = hashlib.sha256(head)
    size = len(head)
    with open(path, "wb", buffering=0) as f, ThreadPoolExecutor(1, thread_name_prefix="reprokit-hash") as pool:
        _write_all(f, memoryview(head))
        for piece in _pieces(items, staging, chunk):
            if len(piece) < _SMALL:
                h.update(piece)
                _write_all(f, piece)
            else:
                hashed = submit(pool, h.update, piece)  # the hash of this piece runs while it is written
                _write_all(f, piece)
                hashed.result()  # before the next piece (the staging buffer is reused)
            size += len(piece)
        os.fsync(f.fileno())
    return h.hexdigest(), size


def read_verified(path: Path, sha256: str, size: int, chunk: int = CHUNK) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file whose bytes hash to ``sha256`` (one read, hashed on the way).

    Tensors of 1 MiB or more are views of one buffer holding the file (no second copy of a state);
    smaller ones, and any whose offset is not aligned to its element size, get their own storage.

    Raises:
        TensorFileError: the file's size or digest differs from the manifest's, or its header does not
            describe its own bytes.
        DoesNotFitError: (exit 125) ``size`` is more memory than this machine has available (checked before the
            buffer is made: ``size`` is the manifest's, not yet verified).
    """
    schema.check_fits(size + 1, str(path), "load its tensors")
    try:
        buf = torch.empty(size + 1, dtype=torch.uint8)  # one byte more: a longer file shows as a size mismatch
    except (RuntimeError, MemoryError) as e:  # memory taken by something else since the check
        from reprokit.errors import DoesNotFitError

        raise DoesNotFitError(f"{path} is {size} bytes in the manifest, and a buffer of that size cannot be made on "
                              f"this machine now ({str(e)[:200]}). Free some memory or use a larger machine.") from None
    whole = memoryview(cast(Any, buf.numpy())).cast("B")
    found, n = read_hashed(path, (whole[a:a + chunk] for a in range(0, size + 1, chunk)))
    if n != size:
        raise TensorFileError(f"size mismatch: {n if n <= size else 'more than ' + str(size)} bytes on disk, "
                              f"{size} in the manifest")
    if found != sha256:
        raise TensorFileError(f"checksum mismatch: sha256 {found}, the manifest says {sha256}")
    return _tensors_of(buf[:size])


def _tensors_of(buf: torch.Tensor) -> dict[str, torch.Tensor]:
    if buf.numel() < 8:
        raise TensorFileError("too short for a safetensors file")
    (n,) = struct.unpack("<Q", bytes(buf[:8].numpy()))
    if n > buf.numel() - 8 or n > schema.MAX_HEADER_BYTES:
        raise TensorFileError(f"declares a {n}-byte header in a {buf.numel()}-byte file (headers are at most "
                              f"{schema.MAX_HEADER_BYTES})")
    data = buf[8 + n:]
    try:
        # The checks verify made on the header it read, made again on the header of the bytes that hashed right
        # (strict JSON, known dtypes, shapes that match their ranges, ranges that tile the data without overlap).
        header = schema.parse_header(bytes(buf[8:8 + n].numpy()), "header")
        if not isinstance(header, dict):
            raise schema.SchemaError("header", "", "is not a JSON object")
        schema.check_header(header, data.numel(), "header")
    except schema.SchemaError as e:
        raise TensorFileError(f"header: {e.problems[0]['problem']}") from None
    out: dict[str, torch.Tensor] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype = BY_CODE[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            start, end = (int(x) for x in info["data_offsets"])
            itemsize = torch.empty((), dtype=dtype).element_size()
            count = 1
            for d in shape:
                count *= d
            if not 0 <= start <= end <= data.numel() or count * itemsize != end - start or min(shape, default=0) < 0:
                raise ValueError(f"range [{start}, {end}] and shape {shape} do not fit the data")
            piece = data[start:end]
            if (8 + n + start) % itemsize or end - start < _SMALL:
                # Own storage for small tensors (some consumers, torch.set_rng_state among them, read
                # the storage from its start) and for those whose offset is not aligned to their element.
                piece = piece.clone()
            out[key] = piece.view(dtype).reshape(shape)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise TensorFileError(f"tensor {key[:80]!r}: {e}") from None
    return out
