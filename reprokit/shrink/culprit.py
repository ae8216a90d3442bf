"""Before blaming data: does the failing step fail from its start state on any data?

Shrinking rows and tokens always ends at *some* row: a step whose start state is already broken (an LR
that blew the weights up, an optimizer state gone bad) fails on every batch, so a search for the smallest
failing batch finds one row, then zero tokens, and names a sample that has nothing to do with it. So the
failing step is run first from its own start state with the batches of other steps of the window in place
of its own (same shapes, healthy: those steps did not fail). When each of them fails the same way, the
cause is upstream of the batch and no row is a culprit; when one passes, the failing batch matters and
the row passes may look for the rows that do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from reprokit import pytree
from reprokit.replayer import RunOutcome, StepInput
from reprokit.shrink.case import Case, what_happened

if TYPE_CHECKING:
    from reprokit.shrink.shrinker import Shrinker

SUBSTITUTES = 3
"""At most this many other steps' batches are tried in place of the failing one (the nearest first)."""

STATE = "state"
"""Verdict: the failing step fails the same way on other steps' batches; the cause is upstream of the data."""
DATA = "data"
"""Verdict: another step's batch, run from the same state, does not fail: the failing batch matters."""
UNTESTED = "untested"
"""Verdict: no other step of the window has a batch of the failing one's shapes, so nothing could be swapped in."""

STATE_SHARE = 0.5
"""For a loss spike: a healthy batch that lifts the loss from the failing step's start state by at least this share of
the recorded rise above the median (without crossing the threshold itself) shows the state making the spike: a
threshold crossed by a few percent is not the batch's doing. A culprit batch stands far above the others."""

STATE_MESSAGE = ("the state fails on any data: the cause is upstream of this batch (weights, LR, optimizer state); "
                 "no sample is to blame")


@dataclass
class StateCheck:
    """What swapping other steps' batches into the failing step showed. ``to_json()`` is shrink's ``state_check``."""

    verdict: str
    """:data:`STATE`, :data:`DATA` or :data:`UNTESTED`."""
    step: int
    """The failing step, run from its start state."""
    tried: list[dict[str, Any]] = field(default_factory=list)
    """One entry per batch swapped in: ``{"batch_of": step, "result": "same failure" | "passed" | ...}``."""
    reason: str | None = None
    """For :data:`UNTESTED`: why nothing could be swapped in."""

    @property
    def message(self) -> str:
        steps = ", ".join(str(t["batch_of"]) for t in self.tried)
        if self.verdict == STATE:
            return (f"{STATE_MESSAGE}. Evidence: step {self.step}, run from its start state with the batch of "
                    f"step{'s' if len(self.tried) > 1 else ''} {steps} in place of its own, failed the same way "
                    f"each time.")
        if self.verdict == DATA:
            ok = next(t["batch_of"] for t in self.tried if t["result"] != "same failure")
            return (f"the batch matters: step {self.step}, run from its start state with the batch of step {ok} in "
                    f"place of its own, did not fail the same way")
        return f"not tested whether the state fails on any data: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "step": self.step, "tried": self.tried, "reason": self.reason,
                "message": self.message}


def check_state(sh: Shrinker, case: Case) -> StateCheck:
    """Run ``case``'s failing step from its start state on up to :data:`SUBSTITUTES` batches of its other steps.

    Each run is judged as a candidate is (same signature, same message template, same origin place), but
    outside the replay budget and the cache: the rows are not the original's, so only the origin's place is
    compared, not its rows.
    """
    last = case.last
    shape = _shape(last.batch)
    others = [inp for inp in reversed(case.inputs[:-1]) if _shape(inp.batch) == shape][:SUBSTITUTES]
    if not others:
        why = ("the window holds the failing step alone" if len(case.inputs) == 1
               else "no other step of the window has a batch of the failing one's shapes")
        return StateCheck(UNTESTED, last.step, reason=why)
    snap = sh.snapshot_at(case, len(case.inputs) - 1)
    if snap is None:
        return StateCheck(UNTESTED, last.step, reason="the steps before the failing one did not replay")
    counters = sh.different_failures, sh.origin_changed
    tried = []
    for other in others:
        swapped = StepInput(last.step, other.batch, last.rng, last.rng_tensors)
        same, out = sh._judge(Case((swapped,), snap[0], snap[1], None, None))
        entry = {"batch_of": other.step, "result": "same failure" if same else what_happened(out)}
        share = None if same else _share_of_rise(sh, out, last.step)
        if share is not None and share >= STATE_SHARE and isinstance(out, RunOutcome):
            same, entry["result"] = True, "same failure"
            entry["note"] = (f"no spike, but the loss rose to {out.losses[last.step]:.4g}: {share:.0%} of the recorded "
                             f"rise above the median")
        tried.append(entry)
        if not same:
            break  # one healthy batch that passes is enough: the failing batch matters
    sh.different_failures, sh.origin_changed = counters
    verdict = STATE if all(t["result"] == "same failure" for t in tried) else DATA
    return StateCheck(verdict, last.step, tried)


def _share_of_rise(sh: Shrinker, out: Any, step: int) -> float | None:
    """For a loss spike: the share of the recorded rise (failing loss minus median) that ``out``'s loss at ``step``
    makes; None where it is not a spike, the run did not reach the step, or its loss is not finite."""
    if sh.spike_rise is None or not isinstance(out, RunOutcome) or out.failure is not None:
        return None
    loss, median = sh.spike_rise
    got = out.losses.get(step)
    if got is None or not math.isfinite(got) or loss <= median:
        return None
    return (got - median) / (loss - median)


def _shape(batch: Any) -> list[tuple[str, Any]]:
    """The batch's structure: each leaf's path with its tensor dtype and shape (other leaves: their type)."""
    return [(path, (leaf.dtype, tuple(leaf.shape)) if isinstance(leaf, torch.Tensor) else type(leaf).__name__)
            for path, leaf in pytree.leaves(batch)]
