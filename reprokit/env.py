"""The environment a bundle was recorded in (env.json)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

from reprokit._version import __version__
from reprokit.code import git_info
from reprokit.errors import StateMismatchError

FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning", "accelerate")
"""Training frameworks whose versions env.json records (under ``frameworks``) when they are installed."""
_ENV_PREFIXES = ("CUDA_", "CUBLAS_", "CUDNN_", "TORCH_", "PYTORCH_", "NCCL_", "OMP_", "MKL_", "NVIDIA_TF32")


def capture_env(code_root: Path | None, devices: list[str] | None = None) -> dict[str, Any]:
    """``env.json``. ``devices``: the GPUs' names, read earlier (after a sticky device error no CUDA call may run)."""
    import torch  # here, not at module level: reprokit.pack imports FRAMEWORKS, and opening an archive
    # (inspect) must not import torch, which takes seconds

    cuda = devices is None and torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": platform.node(),
        "reprokit": __version__,
        "torch": torch.__version__,
        "numpy": _version("numpy"),
        "safetensors": _version("safetensors"),
        "frameworks": {name: v for name in FRAMEWORKS if (v := _version(name)) is not None},
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "devices": devices if devices is not None else
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "cpu_threads": torch.get_num_threads(),
        "memory_bytes": _host_memory(),
        "git": git_info(code_root),
        "env_vars": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
    }


FP32_PRECISION = ("generic", "cuda.matmul", "cudnn", "cudnn.conv", "cudnn.rnn", "mkldnn", "mkldnn.matmul", "mkldnn.conv",
                  "mkldnn.rnn")
"""Where torch >= 2.9 keeps its float32 precision settings (``torch.backends.<name>.fp32_precision``, ``generic`` for
``torch.backends.fp32_precision``), parents before children: ``"none"`` defers to the parent."""


def _fp32_holder(name: str) -> Any:
    import torch

    obj: Any = torch.backends
    for part in () if name == "generic" else name.split("."):
        obj = getattr(obj, part, None)
    return obj if obj is not None and hasattr(obj, "fp32_precision") else None


def determinism_flags() -> dict[str, Any]:
    """Global switches that change numerics; recorded, and applied again on replay.

    On a torch with the per-backend ``fp32_precision`` settings those are the truth (``fp32_precision``); the
    legacy flags (``allow_tf32``, ``get_float32_matmul_precision``) are recorded too where they can be read, for a
    replay on an older torch. Torch refuses to read a legacy flag once the run mixed both APIs: that flag is then left
    out, never guessed from the new settings here.
    """
    import torch

    flags: dict[str, Any] = {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
    }
    fill = getattr(getattr(torch.utils, "deterministic", None), "fill_uninitialized_memory", None)
    if fill is not None:  # under deterministic algorithms, empty tensors are filled with NaN (torch >= 2.1)
        flags["fill_uninitialized_memory"] = bool(fill)
    precision = {name: str(h.fp32_precision) for name in FP32_PRECISION if (h := _fp32_holder(name)) is not None}
    if precision:
        flags["fp32_precision"] = precision
    for key, read in (("matmul_allow_tf32", lambda: bool(torch.backends.cuda.matmul.allow_tf32)),
                      ("cudnn_allow_tf32", lambda: bool(torch.backends.cudnn.allow_tf32)),
                      ("float32_matmul_precision", torch.get_float32_matmul_precision)):
        try:
            flags[key] = read()
        except RuntimeError:  # "you have used mix of the legacy and new APIs": fp32_precision holds it
            pass
    return flags


PRECISION_KEYS = ("fp32_precision", "float32_matmul_precision")
"""The settings of :func:`determinism_flags` that are not booleans: run.json keeps them under ``precision``, because
earlier readers refuse a ``determinism`` value that is not a boolean."""


def split_flags(flags: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(determinism, precision)`` for run.json; :func:`apply_determinism_flags` takes the two merged again."""
    return ({k: v for k, v in flags.items() if k not in PRECISION_KEYS},
            {k: v for k, v in flags.items() if k in PRECISION_KEYS})


def _effective(precision: dict[str, str], name: str) -> str:
    """A ``fp32_precision`` setting with ``"none"`` resolved through its parents."""
    while True:
        value = precision.get(name, "none")
        if value != "none" or name == "generic":
            return value
        name = name.rpartition(".")[0] or "generic"


def apply_determinism_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """Set the flags; returns the previous ones so the caller can put them back.

    A bundle recorded with ``fp32_precision`` settings gets them back through the same API where this torch has it
    (setting the legacy flags after it would leave torch refusing to read them in the replayed code); elsewhere the
    legacy flags are set, from the recording's own legacy values, else resolved from its ``fp32_precision``.
    """
    before = determinism_flags()
    try:
        _apply(flags)
    except Exception as e:
        _apply(before)  # nothing half-set is left behind
        import torch

        raise StateMismatchError(f"the bundle's numerics settings cannot be applied on torch {torch.__version__}: "
                                 f"{type(e).__name__}: {e}. Replay on the torch the bundle names in env.json.") from e
    return before


def _apply(flags: dict[str, Any]) -> None:
    import torch

    torch.use_deterministic_algorithms(bool(flags.get("deterministic_algorithms", False)),
                                       warn_only=bool(flags.get("deterministic_warn_only", False)))
    det = getattr(torch.utils, "deterministic", None)
    if det is not None and hasattr(det, "fill_uninitialized_memory"):
        det.fill_uninitialized_memory = bool(flags.get("fill_uninitialized_memory", True))
    torch.backends.cudnn.deterministic = bool(flags.get("cudnn_deterministic", False))
    torch.backends.cudnn.benchmark = bool(flags.get("cudnn_benchmark", False))
    precision = flags.get("fp32_precision")
    if isinstance(precision, dict) and _fp32_holder("cuda.matmul") is not None:
        for name in FP32_PRECISION:  # parents first: setting one may reach into its children
            holder = _fp32_holder(name)
            if name in precision and holder is not None:
                holder.fp32_precision = str(precision[name])
        return
    tf32 = {"matmul_allow_tf32": False, "cudnn_allow_tf32": True}  # torch's defaults, for bundles without them
    if isinstance(precision, dict):
        tf32 = {"matmul_allow_tf32": _effective(precision, "cuda.matmul") == "tf32",
                "cudnn_allow_tf32": _effective(precision, "cudnn.conv") == "tf32"}
    if "float32_matmul_precision" in flags:
        torch.set_float32_matmul_precision(str(flags["float32_matmul_precision"]))
    torch.backends.cuda.matmul.allow_tf32 = bool(flags.get("matmul_allow_tf32", tf32["matmul_allow_tf32"]))
    torch.backends.cudnn.allow_tf32 = bool(flags.get("cudnn_allow_tf32", tf32["cudnn_allow_tf32"]))


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def _host_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say): a replay of a process that was
    killed from outside (the OOM killer) reports its own peak beside it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
