"""The shrink passes, listed once, here. No torch is imported: the command line reads them for ``--passes`` (its
default and its help). :mod:`reprokit.shrink.passes` holds one function per name (``PASSES``, in this order).
"""

from __future__ import annotations

PASS_NAMES = ("steps", "micro", "rows", "sequence", "tokens")
"""Every pass, in the order the scheduler first runs them. Order matters: fewer steps make every later replay
cheaper. ``steps`` drops steps of the window; ``micro`` micro-batches of a batch of micro-batches; ``rows`` rows of
the failing batch; ``sequence`` cuts its sequence to a window; ``tokens`` sets token values to a neutral one."""
DATA_PASSES = frozenset({"micro", "rows", "sequence", "tokens"})
"""The passes that cut the failing batch: skipped when the state fails on any data (they would name a row)."""
