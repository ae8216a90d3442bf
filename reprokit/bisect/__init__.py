"""``reprokit bisect``: localise a failure over steps, layers/ops, precision and kernels, and commits.

The axes and the precision variants are listed once, in :mod:`reprokit.bisect.registry`, which imports no torch (the
command line reads it for its help). An axis that replays the bundle is one module named after it
(:func:`axis`); every name below is loaded on first use (PEP 562), so reading the registry loads nothing else.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from reprokit.bisect.registry import REPLAY_AXES

if TYPE_CHECKING:
    from reprokit.bisect.commits import BisectError, CommitBisectResult, bisect_commits
    from reprokit.bisect.layers import bisect_layers
    from reprokit.bisect.precision import VARIANTS, bisect_precision
    from reprokit.bisect.steps import StepRules, bisect_steps

_LAZY = {
    "BisectError": "commits", "CommitBisectResult": "commits", "bisect_commits": "commits",
    "bisect_layers": "layers", "VARIANTS": "precision", "bisect_precision": "precision",
    "StepRules": "steps", "bisect_steps": "steps",
}


def axis(name: str) -> tuple[Callable[..., dict[str, Any]], Callable[[dict[str, Any]], str]]:
    """``(bisect_<name>, format_<name>)`` of the replay axis ``name`` (one of :data:`~registry.REPLAY_AXES`).

    Example:
        >>> run, text = axis("steps")                                 # doctest: +SKIP
        >>> print(text(run(open_bundle("repros/bundle-..."))))        # doctest: +SKIP
    """
    if name not in REPLAY_AXES:
        raise ValueError(f"no replay axis {name!r}; the axes are {', '.join(REPLAY_AXES)}")
    module = importlib.import_module(f"{__name__}.{name}")
    return getattr(module, f"bisect_{name}"), getattr(module, f"format_{name}")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = ["VARIANTS", "BisectError", "CommitBisectResult", "StepRules", "axis", "bisect_commits", "bisect_layers",
           "bisect_precision", "bisect_steps"]
