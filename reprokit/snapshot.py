"""Snapshots of training state at near-zero cost to the training loop.

CPU tensors are cloned. CUDA tensors are copied device-to-host on a side stream
into pinned buffers that are allocated once and reused by every later
snapshot, ordered after the training stream with an event. Parameters and
optimizer state only change inside ``optimizer.step()``, so an optimizer step
pre-hook makes the training stream wait (on the GPU, without blocking the host)
for the copy to finish before the first step that would overwrite them; the
forward and backward passes in between overlap with the copy. Other tensors
(module buffers such as BatchNorm statistics, ``TrainState.extra``) may change in
the forward pass, so they are first cloned on the device (small), then copied.

With ``spill_dir`` the state streams through a bounded pinned staging buffer
into a safetensors file on local disk instead of staying in host memory, for
states that do not fit in RAM; that copy is synchronous and its cost is
measured by ``bench/recorder_overhead.py``.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import torch

from reprokit.state import TrainState, capture_rng, capture_state

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"),
                     ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


class SnapshotEngine:
    """Takes snapshots for one Recorder. ``take()`` returns ``(tree, tensors_or_spill_path)``."""

    def __init__(self, state: TrainState, spill_dir: str | Path | None = None, staging_bytes: int = 256 << 20):
        self.state = state
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self.staging_bytes = staging_bytes
        self._buffers: dict[int, torch.Tensor] = {}
        self._stream: Any = None
        self._done: Any = None
        self._staging: torch.Tensor | None = None
        self._hook: Any = state.optimizer.register_step_pre_hook(self._before_optimizer_step)
        self.stats: dict[str, Any] = {"snapshots": 0, "bytes": 0, "pinned_bytes": 0, "host_seconds": 0.0,
                                      "spill_seconds": 0.0}

    # --- ordering ----------------------------------------------------------------

    def _before_optimizer_step(self, *_: Any) -> None:
        if self._done is not None and not self._done.query():
            torch.cuda.current_stream().wait_event(self._done)  # GPU-side wait; the host goes on

    def wait(self) -> None:
        """Block until the last snapshot's copies have landed in host memory."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None

    def detach(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def attach(self) -> None:
        if self._hook is None:
            self._hook = self.state.optimizer.register_step_pre_hook(self._before_optimizer_step)

    def close(self) -> None:
        self.detach()
        self.wait()
        self._buffers.clear()

    # --- taking ------------------------------------------------------------------------

    def take(self, extra_tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor] | Path]:
        t0 = time.perf_counter()
        if self.spill_dir is not None:
            out: tuple[dict[str, Any], dict[str, torch.Tensor] | Path] = self._spill(extra_tree)
        else:
            out = self._in_memory(extra_tree)
        self.stats["snapshots"] += 1
        self.stats["host_seconds"] = time.perf_counter() - t0
        return out

    def _in_memory(self, extra_tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        self.wait()  # the buffers are about to be reused
        protected = self._protected()
        counter = [0]
        cuda = any(p.is_cuda for p in self.state.model.parameters())
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
            self._stream.wait_event(ready)

        copied: dict[tuple, torch.Tensor] = {}

        def copy(t: torch.Tensor) -> torch.Tensor:
            t = t.detach()
            if not t.is_cuda:
                return t.clone(memory_format=torch.contiguous_format)
            key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if key in copied:  # tied weights: one copy (the bundle writer un-shares them)
                return copied[key]
            i = counter[0]
            counter[0] += 1
            buf = self._buffer(i, t)
            if t.data_ptr() in protected:
                buf.copy_(t, non_blocking=True)
            else:  # may change in the next forward (module buffers): clone on the training stream first
                with torch.cuda.stream(main):
                    src = t.clone()
                    cloned = torch.cuda.Event()
                    cloned.record(main)
                self._stream.wait_event(cloned)
                buf.copy_(src, non_blocking=True)
                src.record_stream(self._stream)
            copied[key] = buf
            return buf

        if cuda:
            main = torch.cuda.current_stream()
            with torch.cuda.stream(self._stream):
                tree, tensors = capture_state(self.state, copy=copy)
        else:
            tree, tensors = capture_state(self.state, copy=copy)
        if cuda:
            self._done = torch.cuda.Event()
            self._done.record(self._stream)
        rng_tree, rng_tensors = capture_rng()
        self.stats["bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"state": tree, "rng": rng_tree, **extra_tree}, {**tensors, **rng_tensors}

    def _protected(self) -> set[int]:
        """Data pointers that only ``optimizer.step()`` writes to: parameters and optimizer state."""
        ptrs = {p.data_ptr() for p in self.state.model.parameters()}
        for st in self.state.optimizer.state.values():
            ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        return ptrs

    def _buffer(self, i: int, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(i)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            if buf is not None:
                self.stats["pinned_bytes"] -= buf.numel() * buf.element_size()
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._buffers[i] = buf
            self.stats["pinned_bytes"] += buf.numel() * buf.element_size()
        return buf

    # --- spilling to disk ----------------------------------------------------------------

    def _spill(self, extra_tree: dict[str, Any]) -> tuple[dict[str, Any], Path]:
        """Stream the state through a bounded staging buffer into a safetensors file; returns its path."""
        assert self.spill_dir is not None
        t0 = time.perf_counter()
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        tree, tensors = capture_state(self.state, copy=lambda t: t.detach())  # references, no copies
        rng_tree, rng_tensors = capture_rng()
        tensors = {**tensors, **rng_tensors}
        path = self.spill_dir / f"snapshot-{os.getpid()}-{id(self)}.safetensors"
        tmp = path.with_suffix(".tmp")
        write_safetensors_streaming(tmp, tensors, self._staging_for)
        os.replace(tmp, path)
        self.stats["bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
        self.stats["spill_seconds"] = time.perf_counter() - t0
        return {"state": tree, "rng": rng_tree, **extra_tree}, path

    def _staging_for(self, n: int) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty(self.staging_bytes, dtype=torch.uint8,
                                        pin_memory=torch.cuda.is_available())
            self.stats["pinned_bytes"] += self.staging_bytes
        return self._staging[:n]


def write_safetensors_streaming(path: Path, tensors: dict[str, torch.Tensor], staging: Any,
                                chunk: int = 256 << 20) -> None:
    """Write a safetensors file chunk by chunk, never holding more than ``chunk`` bytes on the host."""
    header: dict[str, Any] = {}
    offset = 0
    items = sorted(tensors.items())
    for key, t in items:
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"{key}: dtype {t.dtype} cannot be stored in safetensors")
        n = t.numel() * t.element_size()
        header[key] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in items:
            flat = t.detach().contiguous().reshape(-1).view(torch.uint8) if t.numel() else None
            if flat is None:
                continue
            for a in range(0, flat.numel(), chunk):
                part = flat[a:a + chunk]
                if part.is_cuda:
                    buf = staging(part.numel())
                    buf.copy_(part)
                    f.write(buf.numpy().data)
                else:
                    f.write(part.numpy().data)
        f.flush()
        os.fsync(f.fileno())
