"""Which errors kill the GPU for good, and the CPU exceptions that are their CPU face: classified from the texts the
CUDA runtime and torch's CPU kernels really produce."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reprokit.device_error import STICKY_TEXTS, behind, cpu_face, is_sticky, reproduces
from reprokit.signature import Failure, from_exception

# What torch raises for them: "CUDA error: <the runtime's text>" plus its advice lines.
TORCH_CUDA = "CUDA error: {}\nCUDA kernel errors might be asynchronously reported at some other API call, so the " \
             "stacktrace below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1"


@pytest.mark.parametrize("text", STICKY_TEXTS)
def test_every_sticky_cuda_error_is_a_device_error_as_torch_raises_it(text):
    for cls in (RuntimeError, torch.AcceleratorError):
        e = cls(TORCH_CUDA.format(text))
        assert is_sticky(e)
        f = from_exception(e, 7)
        assert f.kind == "device_error" and f.exc_type == cls.__name__ and f.step == 7


@pytest.mark.parametrize("message", [
    "CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.10 GiB total capacity)",
    TORCH_CUDA.format("invalid configuration argument"),  # a bad launch: the context still works
    TORCH_CUDA.format("out of memory"),
    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!",
    "mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)",
])
def test_errors_after_which_the_device_still_works_are_not_device_errors(message):
    assert not is_sticky(RuntimeError(message))
    assert from_exception(RuntimeError(message), 3).kind == "exception"


def test_a_sticky_error_raised_from_or_during_another_is_found_in_the_chain():
    try:
        try:
            raise torch.AcceleratorError(TORCH_CUDA.format("an illegal memory access was encountered"))
        except RuntimeError as e:
            raise ValueError("the training loop gave up") from e
    except ValueError as wrapped:
        assert is_sticky(wrapped) and from_exception(wrapped, 1).kind == "device_error"
    triton = RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
    assert is_sticky(triton)
    assert not is_sticky(IndexError("device-side assert triggered"))  # only RuntimeErrors come from the runtime


def _raised(fn) -> BaseException:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the real exception is the subject
        return e
    raise AssertionError("did not raise")


CPU_FACES = {
    "embedding": lambda: torch.nn.Embedding(10, 4)(torch.tensor([[1, 10]])),
    "negative id": lambda: torch.nn.Embedding(10, 4)(torch.tensor([-1])),
    "cross_entropy": lambda: F.cross_entropy(torch.randn(2, 5), torch.tensor([1, 5])),
    "cross_entropy over positions": lambda: F.cross_entropy(torch.randn(2, 5, 3), torch.tensor([[1, 5, 0], [0] * 3])),
    "nll_loss": lambda: F.nll_loss(torch.randn(2, 5), torch.tensor([1, 7])),
    "gather": lambda: torch.gather(torch.randn(2, 5), 1, torch.tensor([[5], [1]])),
    "index_select": lambda: torch.index_select(torch.randn(5), 0, torch.tensor([5])),
    "indexing": lambda: torch.randn(5)[torch.tensor([7])],
    "scatter": lambda: torch.randn(2, 5).scatter_(1, torch.tensor([[6]]), 1.0),
    "one_hot": lambda: F.one_hot(torch.tensor([3]), 3),
}


@pytest.mark.parametrize("name", CPU_FACES)
def test_an_out_of_range_index_on_the_cpu_is_the_cpu_face_of_a_device_assert(name):
    f = from_exception(_raised(CPU_FACES[name]), 6)
    assert f.kind == "exception" and cpu_face(f), f


def test_other_cpu_exceptions_are_not_a_cpu_face():
    assert not cpu_face(from_exception(_raised(lambda: torch.randn(2, 3) @ torch.randn(4, 5)), 6))
    assert not cpu_face(Failure("exception", 6, exc_type="ValueError", message="index out of range"))
    assert not cpu_face(Failure("nonfinite_loss", 6, message="loss = nan"))
    assert not cpu_face(None)


def test_a_device_error_is_reproduced_by_its_cpu_face_only_on_the_cpu_and_at_its_step():
    recorded = from_exception(RuntimeError(TORCH_CUDA.format("device-side assert triggered")), 6)
    face = from_exception(_raised(CPU_FACES["embedding"]), 6)
    assert reproduces(recorded, face, "cpu")
    assert not reproduces(recorded, face, "cuda")  # on a GPU only the device error itself counts
    assert not reproduces(recorded, from_exception(_raised(CPU_FACES["embedding"]), 5), "cpu")
    assert reproduces(recorded, from_exception(torch.AcceleratorError(TORCH_CUDA.format(
        "device-side assert triggered")), 6), "cuda") is False  # another class than recorded: RuntimeError
    assert reproduces(recorded, from_exception(RuntimeError(TORCH_CUDA.format("device-side assert triggered")), 6),
                      "cuda")
    assert not reproduces(recorded, None, "cpu")
    # A recorded exception is judged as always: the CPU-face rule is for device errors alone.
    assert not reproduces(face, Failure("exception", 6, exc_type="KeyError", message="x"), "cpu")


def _cublas(step: int = 8) -> Failure:
    return Failure("exception", step, exc_type="RuntimeError", frame="rk_vocab.py:forward",
                   message="CUDA error: CUBLAS_STATUS_INTERNAL_ERROR when calling `cublasCreate(handle)`")


def test_the_device_error_behind_a_library_s_exception_is_the_step_s_failure():
    """cuBLAS creating its handle on a context that an embedding's assert had just killed: the wait after it
    raises the assert itself, which is the step's failure (same step and frame, the first exception kept)."""
    def dead():
        raise torch.AcceleratorError(TORCH_CUDA.format("device-side assert triggered"))

    f = behind(_cublas(), dead)
    assert (f.kind, f.step, f.exc_type, f.frame) == ("device_error", 8, "AcceleratorError", "rk_vocab.py:forward")
    assert f.message == "CUDA error: device-side assert triggered"
    assert f.detail["device_error"]["surfaced_as"].startswith("RuntimeError: CUDA error: CUBLAS_STATUS_INTERNAL")
    recorded = Failure("device_error", 8, exc_type="AcceleratorError", message=f.message)
    assert reproduces(recorded, f, "cuda") and not reproduces(recorded, _cublas(), "cuda")


def test_an_exception_with_a_working_device_or_a_non_sticky_wait_error_stays_itself():
    waited = []
    assert behind(_cublas(), lambda: waited.append(1)) == _cublas() and waited == [1]

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    assert behind(_cublas(), oom) == _cublas()
    nan = Failure("nonfinite_loss", 3)
    assert behind(nan, lambda: pytest.fail("a failure that is not an exception needs no wait")) is nan
