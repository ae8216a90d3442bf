"""Sticky device errors: which exceptions mean the GPU is gone for this process, and how the recorder still knows
what reached host memory.

A *sticky* CUDA error (a device-side assert, an illegal memory access, an unspecified launch failure, ...) leaves
the process's CUDA context unusable: every later CUDA call fails with the same error, so nothing can be copied off
the GPU, synchronised or queried any more ("there is no workaround, the whole CUDA context is in an incorrect
state"). :func:`is_sticky` tells such an error from any other (an out-of-memory error, a bad launch configuration:
the context still works after those).

The recorder therefore keeps every byte a bundle needs in host memory before the step's kernels run, and learns
what has landed there without asking the device: a :class:`HostMarker` is a tiny pinned host buffer that a
device-to-host copy queued on a stream fills with a number. Stream order makes the marker land only after
everything queued before it on that stream has run, so reading the marker (plain memory, no CUDA call) says which
step's batch copy, or which snapshot's copies, are complete, even after the context died.

On the CPU, the same bugs are clean exceptions: an out-of-range index raises ``IndexError`` (or a ``RuntimeError``
saying "out of bounds"), which :func:`cpu_face` recognises as the CPU face of a device-side assert.

Example:
    >>> is_sticky(RuntimeError("CUDA error: device-side assert triggered"))
    True
    >>> is_sticky(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    False
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from reprokit.signature import Failure

STICKY_TEXTS = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "misaligned address",
    "an illegal instruction was encountered",
    "hardware stack error",
    "invalid program counter",
    "operation not supported on global/shared address space",
    "the launch timed out and was terminated",
    "uncorrectable ECC error encountered",
)
"""The runtime's texts (``cudaGetErrorString``) of the errors that leave a CUDA context unusable: cudaErrorAssert,
cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorMisalignedAddress, cudaErrorIllegalInstruction,
cudaErrorHardwareStackError, cudaErrorInvalidPc, cudaErrorInvalidAddressSpace, cudaErrorLaunchTimeout,
cudaErrorECCUncorrectable. torch puts them after ``CUDA error: ``; Triton after ``Triton Error [CUDA]: ``."""

_STICKY = re.compile("|".join(re.escape(t) for t in STICKY_TEXTS), re.IGNORECASE)
_CPU_FACE = re.compile(r"out of (bounds|range)|must be smaller than num_classes", re.IGNORECASE)
"""What the CPU kernels say for an index a GPU kernel asserts on: ``index out of range in self`` (embedding,
index_select), ``Target 5 is out of bounds.`` (cross_entropy, nll_loss), ``index 5 is out of bounds for dimension 1
with size 5`` (gather, scatter, indexing), ``Class values must be smaller than num_classes.`` (one_hot)."""

def sticky_text(text: str | None) -> bool:
    """Does ``text`` (an exception's message) hold one of :data:`STICKY_TEXTS`?"""
    return bool(text) and _STICKY.search(text) is not None  # type: ignore[arg-type]


def is_sticky(exc: BaseException | None) -> bool:
    """Is ``exc`` a sticky device error: a ``RuntimeError`` (``torch.AcceleratorError`` is one) whose message is one
    of :data:`STICKY_TEXTS`, or an exception raised from one (its ``__cause__`` / ``__context__``, a few deep)?

    Example:
        >>> is_sticky(IndexError("index out of range in self"))
        False
    """
    seen = 0
    while exc is not None and seen < 5:
        if isinstance(exc, RuntimeError) and sticky_text(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def cpu_face(failure: Failure | None) -> bool:
    """Is ``failure`` an exception that an out-of-range index raises on the CPU, where a GPU kernel asserts instead
    (``IndexError``, or a ``RuntimeError`` saying the index is out of bounds)?

    Example:
        >>> from reprokit.signature import Failure
        >>> cpu_face(Failure("exception", 6, exc_type="IndexError", message="index out of range in self"))
        True
    """
    if failure is None or failure.kind != "exception":
        return False
    if failure.exc_type == "IndexError":
        return True
    return failure.exc_type == "RuntimeError" and _CPU_FACE.search(failure.message or "") is not None


def reproduces(recorded: Failure, failure: Failure | None, device_type: str) -> bool:
    """Does ``failure`` (a replay's, on a device of ``device_type``) reproduce ``recorded``?

    The usual rule (:meth:`Failure.same_as` at the same step), and for a recorded ``device_error`` replayed on the
    CPU also the exception it is the GPU face of, at the same step (see :func:`cpu_face`).
    """
    if failure is None:
        return False
    if failure.same_as(recorded, step=True):
        return True
    return recorded.kind == "device_error" and device_type == "cpu" and failure.step == recorded.step and \
        cpu_face(failure)


def behind(failure: Failure, probe: Callable[[], Any]) -> Failure:
    """The device error behind a step's exception, where there is one; else ``failure`` itself.

    A kernel's assert reaches the host at the next call that waits for the device, and a library call in between
    may fail first, for that reason alone: cuBLAS creating its handle on a context an embedding's assert just
    killed raises ``CUBLAS_STATUS_INTERNAL_ERROR`` (seen replaying a one-step window on an H200, the step's first
    matmul right after the bad lookup). ``probe`` waits for the device once (replay: ``torch.cuda.synchronize`` of its
    device); where it raises a sticky error, the step's failure is that device error, at the same step
    and frame, and ``detail.device_error.surfaced_as`` keeps the exception it surfaced as.

    Example:
        >>> from reprokit.signature import Failure
        >>> def dead(): raise RuntimeError("CUDA error: device-side assert triggered")
        >>> f = behind(Failure("exception", 8, exc_type="RuntimeError", message="CUBLAS_STATUS_INTERNAL_ERROR"), dead)
        >>> (f.kind, f.step, f.detail["device_error"]["surfaced_as"])
        ('device_error', 8, 'RuntimeError: CUBLAS_STATUS_INTERNAL_ERROR')
    """
    if failure.kind != "exception":
        return failure
    try:
        probe()
    except Exception as e:
        return surfaced_as(failure, e) if is_sticky(e) else failure
    return failure


def surfaced_as(failure: Failure, error: BaseException) -> Failure:
    """``failure`` (a step's exception) as the device error ``error`` (a sticky CUDA error met after it): the same
    step and frame, ``detail.device_error.surfaced_as`` keeping the exception the step raised. What :func:`behind`
    gives when its probe raises ``error``; the recorder calls it with the error it has already met. A failure of
    another kind (a NaN seen before the device died) is returned as it is.

    Example:
        >>> from reprokit.signature import Failure
        >>> f = surfaced_as(Failure("exception", 0, exc_type="RuntimeError", message="CUBLAS_STATUS_INTERNAL_ERROR"),
        ...                 RuntimeError("CUDA error: device-side assert triggered"))
        >>> (f.kind, f.step, f.message, f.detail["device_error"]["surfaced_as"])
        ('device_error', 0, 'CUDA error: device-side assert triggered', 'RuntimeError: CUBLAS_STATUS_INTERNAL_ERROR')
        >>> surfaced_as(Failure("nonfinite_loss", 3), RuntimeError("CUDA error: an illegal memory access")).kind
        'nonfinite_loss'
    """
    if failure.kind != "exception":
        return failure
    return dataclasses.replace(
        failure, kind="device_error", exc_type=type(error).__qualname__, message=str(error).splitlines()[0][:500],
        detail={**failure.detail, "device_error": {"surfaced_as": f"{failure.exc_type}: {failure.message}"}})


def keep_to_exit(obj: Any) -> None:
    """Never free ``obj`` (nor what it holds): its reference count is raised for good, and the OS takes the memory
    back at exit.

    For host buffers that copies used once the CUDA context is dead: freeing a pinned buffer a non-blocking copy
    used makes torch record a CUDA event for it, which fails on a dead context, inside a deleter, and ends the
    process with ``terminate called after throwing an instance of 'c10::AcceleratorError'`` in place of the user's
    own error exit.
    """
    import ctypes

    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


class HostMarker:
    """A number the GPU writes into pinned host memory in stream order, read by the host as plain memory.

    :meth:`mark` queues a device-to-host copy of ``value`` on the current stream (one ``cudaMemcpyAsync``, no
    kernel: the value is read from a small table of numbers kept on the device, modulo its size). Once it lands,
    everything queued on that stream before it has run. :meth:`last` reads the host memory: no CUDA call, so it
    answers on a dead context too.

    Values grow by at most ``PERIOD`` between a mark and the landing of the one before (the device is never that
    far behind the host); ``last()`` undoes the modulo against the last value marked.
    """

    PERIOD = 1 << 16
    _tables: dict[Any, torch.Tensor] = {}

    def __init__(self, device: torch.device):
        import torch

        table = HostMarker._tables.get(device)
        if table is None:
            table = torch.arange(self.PERIOD, dtype=torch.int32, device=device)
            torch.cuda.current_stream(device).synchronize()  # once per device: ready for copies on any stream
            HostMarker._tables[device] = table
        self.device = device
        self._table = table
        self.host = torch.full((1,), -1, dtype=torch.int32, pin_memory=True)
        self._view = self.host.numpy()
        self.issued: int | None = None
        """The last value marked (queued), landed or not."""

    def mark(self, value: int) -> None:
        """Queue the copy of ``value`` (>= the last one) on the current stream of this marker's device."""
        i = value % self.PERIOD
        self.host.copy_(self._table[i:i + 1], non_blocking=True)
        self.issued = value

    def last(self) -> int | None:
        """The last value whose copy has landed (None: none has). Plain host memory: safe on a dead context."""
        got = int(self._view[0])
        if got < 0 or self.issued is None:
            return None
        return self.issued - ((self.issued - got) % self.PERIOD)

    def landed(self, value: int) -> bool:
        """Has the mark of ``value`` (or a later one) landed?"""
        last = self.last()
        return last is not None and last >= value


__all__ = ["STICKY_TEXTS", "HostMarker", "behind", "cpu_face", "is_sticky", "keep_to_exit", "reproduces", "sticky_text"]
