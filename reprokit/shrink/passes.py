"""The shrink passes, each a small function, bound by name to the one list of passes (:mod:`reprokit.shrink.registry`).

The contract, as :meth:`reprokit.shrink.shrinker.Shrinker.run` uses it:

* A pass takes the shrinker and the current best case and makes one deterministic
  search over its own kind of reduction. It does not loop to its own fixpoint: the
  scheduler reruns every pass, the ones that just made progress first, until a whole
  round changes nothing or the replay budget runs out.
* Every candidate goes through ``shrinker.test``, which caches, counts the budget
  (raising ``BudgetExhausted`` when it is spent), accepts only the same failure, and
  keeps the smallest interesting case it has seen as ``shrinker.best``. The scheduler
  reads ``shrinker.best`` after each pass, never the pass's return value, so a pass cut
  short by the budget loses nothing it found.
* A pass returns the case its search settled on (already seen by ``shrinker.test``, so
  never smaller than ``shrinker.best``), or ``None`` when it found nothing smaller; the
  return value is for the pass's own tests and for reading, not for the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from reprokit.registry import bind
from reprokit.search import ddmin, find_integer, shortest_window
from reprokit.shrink import micro
from reprokit.shrink.batch import neutralise, select_rows, select_seq, token_positions
from reprokit.shrink.case import Case
from reprokit.shrink.registry import PASS_NAMES

if TYPE_CHECKING:
    from reprokit.shrink.shrinker import Shrinker

Pass = Callable[["Shrinker", Case], "Case | None"]


def steps(sh: Shrinker, case: Case) -> Case | None:
    """Fewest steps: the failing step alone from the state just before it, else the shortest failing suffix."""
    n = len(case.inputs)
    if n <= 1:
        return None

    def suffix(k: int) -> Case | None:
        snap = sh.snapshot_at(case, k)
        return None if snap is None else replace(case, inputs=case.inputs[k:], snapshot=snap[0], snap_id=snap[1])

    def fails(k: int) -> bool:
        c = suffix(k)
        return c is not None and sh.test(c)

    if fails(n - 1):
        return suffix(n - 1)
    k = find_integer(lambda k: k < n - 1 and fails(k))
    return suffix(k) if k else None


def micro_batches(sh: Shrinker, case: Case) -> Case | None:
    """Fewest micro-batches of the failing update: whole ones dropped, before any row inside one."""
    batch = case.last.batch
    lay = micro.layout(batch)
    if lay is None or case.rows is None:
        return None
    current = case.rows
    ks = list(dict.fromkeys(k for k, _ in current))
    if len(ks) < 2:
        return None

    def make(keep: list[int]) -> Case | None:
        kept = [u for u in current if u[0] in keep]
        cut = micro.select(batch, lay, current, kept)
        return None if cut is None else case.with_last(cut, rows=tuple(kept))

    def fails(keep: list[int]) -> bool:
        c = make(keep)
        return c is not None and sh.test(c)

    keep = ddmin(ks, fails)
    return make(keep) if len(keep) < len(ks) else None


def rows(sh: Shrinker, case: Case) -> Case | None:
    """Fewest rows of the failing batch (delta debugging over the batch dimension; over each micro-batch's own
    rows for a batch of micro-batches)."""
    batch = case.last.batch
    lay = micro.layout(batch)
    if lay is not None:
        return _micro_rows(sh, case, lay)
    n = case.n_rows  # what the rows pass kept, not a guess: a cut (x, y) of one row may read as two samples
    if not n or n < 2:
        return None
    origin = case.rows or tuple(range(n))

    def make(keep: list[int]) -> Case:
        return case.with_last(select_rows(batch, n, keep), rows=tuple(origin[i] for i in keep))

    keep = ddmin(list(range(n)), lambda ks: sh.test(make(ks)))
    return make(keep) if len(keep) < n else None


def _micro_rows(sh: Shrinker, case: Case, lay: micro.Layout) -> Case | None:
    current = case.rows
    if current is None or len(current) < 2:
        return None

    def make(keep: list[tuple[int, int]]) -> Case | None:
        cut = micro.select(case.last.batch, lay, current, keep)
        return None if cut is None else case.with_last(cut, rows=tuple(keep))

    def fails(keep: list[tuple[int, int]]) -> bool:
        c = make(keep)
        return c is not None and sh.test(c)

    keep = ddmin(list(current), fails)
    return make(keep) if len(keep) < len(current) else None


def sequence(sh: Shrinker, case: Case) -> Case | None:
    """Shortest contiguous window along the sequence dimension (prefix and suffix trimmed by binary search)."""
    batch = case.last.batch
    lay = micro.layout(batch)
    n, s = case.rows_and_seq()  # for micro-batches, s is theirs and n is not used (each is cut on its own)
    if not s or s < 2:
        return None
    base = case.seq[0] if case.seq else 0

    def make(lo: int, hi: int) -> Case | None:
        cut = micro.cut_seq(batch, lay, s, lo, hi) if lay is not None else select_seq(batch, n, s, lo, hi)
        return None if cut is None else case.with_last(cut, seq=(base + lo, base + hi))

    def fails(lo: int, hi: int) -> bool:
        c = make(lo, hi)
        return c is not None and sh.test(c)

    lo, hi = shortest_window(s, fails)
    return make(lo, hi) if (lo, hi) != (0, s) else None


def tokens(sh: Shrinker, case: Case) -> Case | None:
    """Fewest meaningful values: everything else set to 0 (floats) or the pad id (integers)."""
    batch = case.last.batch
    positions = token_positions(batch, sh.pad_id)
    if not positions:
        return None

    def make(keep: list[tuple[str, int]]) -> Case:
        return case.with_last(neutralise(batch, set(keep), sh.pad_id))

    keep = [] if sh.test(make([])) else ddmin(positions, lambda ks: sh.test(make(ks)))
    return make(keep) if len(keep) < len(positions) else None


PASSES: dict[str, Pass] = bind(PASS_NAMES, {"steps": steps, "micro": micro_batches, "rows": rows, "sequence": sequence,
                                            "tokens": tokens}, "shrink passes")
"""The function of each pass :data:`reprokit.shrink.registry.PASS_NAMES` lists (the one list), in its order."""
