"""``reprokit shrink``: a scheduler plus small named passes.

The passes are listed once, in :mod:`reprokit.shrink.registry`, which imports no torch (the command line reads it
for its help); :data:`PASSES` maps each to its function. Every name below is loaded on first use (PEP 562), so
reading the registry loads nothing else.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reprokit.shrink.passes import PASSES
    from reprokit.shrink.shrinker import FlakyFailure, ShrinkResult, shrink

_LAZY = {"PASSES": "passes", "FlakyFailure": "shrinker", "ShrinkResult": "shrinker", "shrink": "shrinker"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = ["PASSES", "FlakyFailure", "ShrinkResult", "shrink"]
