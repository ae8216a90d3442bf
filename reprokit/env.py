"""The environment a bundle was recorded in (env.json)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any

from reprokit._version import __version__
from reprokit.code import git_info

FRAMEWORKS = ("transformers", "lightning", "pytorch_lightning", "accelerate")
"""Training frameworks whose versions env.json records (under ``frameworks``) when they are installed."""
_ENV_PREFIXES = ("CUDA_", "CUBLAS_", "CUDNN_", "TORCH_", "PYTORCH_", "NCCL_", "OMP_", "MKL_", "NVIDIA_TF32")


def capture_env(code_root: Path | None) -> dict[str, Any]:
    import torch  # here, not at module level: reprokit.pack imports FRAMEWORKS, and opening an archive
    # (inspect) must not import torch (issue 17)

    cuda = torch.cuda.is_available()
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
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "cpu_threads": torch.get_num_threads(),
        "git": git_info(code_root),
        "env_vars": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
    }


def determinism_flags() -> dict[str, Any]:
    """Global switches that change numerics; recorded, and applied again on replay."""
    import torch

    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
    }


def apply_determinism_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """Set the flags; returns the previous ones so the caller can put them back."""
    import torch

    before = determinism_flags()
    torch.use_deterministic_algorithms(bool(flags.get("deterministic_algorithms", False)))
    torch.backends.cudnn.deterministic = bool(flags.get("cudnn_deterministic", False))
    torch.backends.cudnn.benchmark = bool(flags.get("cudnn_benchmark", False))
    torch.backends.cuda.matmul.allow_tf32 = bool(flags.get("matmul_allow_tf32", False))
    torch.backends.cudnn.allow_tf32 = bool(flags.get("cudnn_allow_tf32", True))
    return before


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None
