"""``reprokit bisect``: localise a failure over steps, layers/ops, precision and kernels, and commits.

Each axis is one function registered in ``AXES``; each takes an opened bundle
and returns a JSON-able dict (commits also needs the git range).
"""

from reprokit.bisect.commits import BisectError, CommitBisectResult, bisect_commits
from reprokit.bisect.layers import bisect_layers, format_layers
from reprokit.bisect.precision import VARIANTS, bisect_precision, format_precision
from reprokit.bisect.steps import StepRules, bisect_steps, format_steps

AXES = {
    "steps": (bisect_steps, format_steps),
    "layers": (bisect_layers, format_layers),
    "precision": (bisect_precision, format_precision),
}

__all__ = ["AXES", "VARIANTS", "BisectError", "CommitBisectResult", "StepRules", "bisect_commits", "bisect_layers",
           "bisect_precision", "bisect_steps"]
