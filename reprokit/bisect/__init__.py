"""``reprokit bisect``: localise a failure over commits (and, later, steps, layers, precision)."""

from reprokit.bisect.commits import BisectError, CommitBisectResult, bisect_commits

__all__ = ["BisectError", "CommitBisectResult", "bisect_commits"]
