"""``reprokit shrink``: a scheduler plus small named passes (see passes.PASSES)."""

from reprokit.shrink.passes import PASSES
from reprokit.shrink.shrinker import FlakyFailure, ShrinkResult, shrink

__all__ = ["PASSES", "FlakyFailure", "ShrinkResult", "shrink"]
