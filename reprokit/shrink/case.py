"""The thing being shrunk: a window of steps, its starting snapshot, and how it maps to the original; and what a
candidate's replay did, in words. Batch surgery is :mod:`reprokit.shrink.batch`."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

from reprokit.replayer import RunOutcome, StepInput
from reprokit.shrink import micro
from reprokit.shrink.batch import batch_size, seq_len, tensor_leaves, token_positions
from reprokit.signature import Failure

Snapshot = tuple[dict, dict]


@dataclass(frozen=True, eq=False)
class Case:
    """A candidate repro: run ``inputs`` from ``snapshot``; it is interesting if it fails the same way."""

    inputs: tuple[StepInput, ...]
    snapshot: Snapshot
    snap_id: int
    rows: tuple[Any, ...] | None
    """Positions, in the original failing batch, of the rows still in the last batch: ints, or ``(micro-batch,
    row)`` pairs for a batch of micro-batches (see :mod:`reprokit.shrink.micro`)."""
    seq: tuple[int, int] | None
    """The original ``[lo, hi)`` the last batch's sequence window covers."""

    @property
    def last(self) -> StepInput:
        return self.inputs[-1]

    @property
    def n_rows(self) -> int | None:
        """Rows of the last batch (``(micro-batch, row)`` pairs for a batch of micro-batches): the count the rows
        pass kept once it ran (it knew the original's row dimension; a cut batch of one row may be ambiguous to
        :func:`batch_size`), else :func:`rows_and_seq`'s reading (None when the row dimension cannot be told)."""
        return self.rows_and_seq()[0]

    def rows_and_seq(self) -> tuple[int | None, int | None]:
        """:attr:`n_rows` and the sequence length read with it (see :func:`rows_and_seq`)."""
        return rows_and_seq(self.last.batch, len(self.rows) if self.rows is not None else None)

    def key(self) -> str:
        h = hashlib.sha1(str(self.snap_id).encode())
        for inp in self.inputs:
            h.update(inp.digest.encode())
        return h.hexdigest()

    def with_last(self, batch: Any, **changes: Any) -> Case:
        last = StepInput(self.last.step, batch, self.last.rng, self.last.rng_tensors)
        return replace(self, inputs=(*self.inputs[:-1], last), **changes)

    def sort_key(self, pad_id: int = 0) -> tuple[int, int, int, int, int]:
        """The one definition of "smaller": fewer steps, then rows, sequence, meaningful tokens, elements."""
        b = self.last.batch
        n, s = self.rows_and_seq()
        elements = sum(t.numel() for t in tensor_leaves(b))
        return (len(self.inputs), n or 0, s or 0, len(token_positions(b, pad_id)), elements)


def rows_and_seq(batch: Any, n: int | None = None) -> tuple[int | None, int | None]:
    """The number of rows and the sequence length; for micro-batches, the rows of all of them. ``(None, None)``
    when the row dimension cannot be told (:func:`reprokit.shrink.micro.ambiguous`).

    ``n``: the row count when it is known (:attr:`Case.n_rows`: what the rows pass kept), else it is read from
    the batch (:func:`batch_size`, or the micro-batches' rows).
    """
    lay = micro.layout(batch)
    if lay is not None:
        return (n if n is not None else len(micro.units(batch, lay))), micro.seq_of(batch, lay)
    if micro.ambiguous(batch):
        return None, None
    n = n if n is not None else batch_size(batch)
    return n, seq_len(batch, n)


def what_happened(out: RunOutcome | dict) -> str:
    """A replay that did not count as the same failure, in words."""
    if isinstance(out, dict) and not out.get("per_run"):
        return "the replay gave no verdict: it crashed or timed out"
    if not failed(out):
        return "it passed"
    return f"it failed otherwise: {failure_of(out).describe()}"


def failure_of(out: RunOutcome | dict) -> Failure:
    """The failure of a run that failed (in process, or the JSON of an isolated replay)."""
    failure = out.failure if isinstance(out, RunOutcome) else Failure.from_json(out["per_run"][0]["failure"])
    assert failure is not None
    return failure


def failed(out: RunOutcome | dict) -> bool:
    """Whether a run failed: in process, in any way; the JSON of an isolated replay, otherwise than recorded."""
    if isinstance(out, RunOutcome):
        return out.failure is not None
    return bool(out.get("per_run") and out["per_run"][0].get("different_failure"))
