"""Keep training after a failure: roll back in memory, prove the culprit rows, skip them, go on.

With ``Recorder(on_failure="skip")`` a failing step first writes its bundle as always; then, in the running process
and within ``skip_budget_s``, the recorder replays its window from the snapshot it holds in memory and decides whether
some rows of the failing batch are the cause. It skips them only when the evidence holds (the replays are in
:mod:`reprokit.skip_proof`):

1. **Reproduced.** The window, replayed from the in-memory snapshot with its recorded batches and RNG, fails at
   the failing step with the recorded signature (for a non-finite failure: at the same origin); the failing step
   run once more from the replayed state before it fails the same way again (a flaky failure is never skipped).
2. **The state is sound.** The failing step, run from that state on a healthy batch of another step of the window
   (same shapes), does not fail the same way (shrink's state check, :mod:`reprokit.shrink.culprit`): a state that
   fails on any data (an LR or optimizer problem) has no culprit rows.
3. **Culprit rows.** Shrink's ``rows`` pass (delta debugging over whole rows, each candidate judged as shrink judges
   it) finds rows C that fail alone, repeated on the rows left while they still fail; C is not the whole batch.
4. **Without them it passes.** The failing step on the batch without the rows of C (a smaller batch, as the run
   would have had it had they never been in the data) runs with no failure of any kind.
5. **With only them it fails.** The failing step on a batch of the original shapes holding the rows of C at their
   positions and healthy rows elsewhere (the rows of the healthy batch of 2; where no batch of the same shapes
   exists, the other rows masked to 0 / the pad id) fails the same way.

The run then goes on from the state of 4: model, optimizer, scheduler, scaler, RNG and detector state are those of
a run whose batch never held those rows. Anything else (the failure did not reproduce or is flaky, the state fails
on any data, no rows to blame, the evidence did not hold, the budget ran out, ``max_skips`` reached) stops the run as
``on_failure="raise"`` does, and a note on the raised error says why it did not skip.

Cost: one replay of the window up to the failing step (never more than one window per failure: no earlier snapshot
is used), then single runs of the failing step (about 2·log2(rows) per culprit, and a few checks).

Under torch.distributed every rank takes part or none does: the ranks agree through files beside the incident's
(:mod:`reprokit.distributed.team`, never a collective) and replay in step (the model's collectives run in every
replay); the culprit rank skips its rows and the others roll back with it (:func:`reprokit.skip_proof.prove_together`).
Through the Hugging Face Trainer callback, the rows are those of the update's micro-batches.

Each skip is a line of ``out_dir/skips.jsonl`` (:mod:`reprokit.skip_journal`); ``reprokit.skip_list(out_dir)``
gives the dataset indices to keep out of a resumed run, and ``Recorder(skip_indices=...)`` drops those rows from the
batches it is given.
"""

from __future__ import annotations

import datetime as _dt
import math
import sys
import warnings
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from reprokit._version import __version__
from reprokit.errors import ConfigError, RecorderWarning
from reprokit.signature import DEATHS, Failure, FailureKind
from reprokit.skip_journal import JOURNAL, JOURNAL_FORMAT, JOURNAL_VERSION, append_entry

if TYPE_CHECKING:
    from reprokit.distributed.team import Team
    from reprokit.record import Recorder
    from reprokit.skip_proof import Clock, LiveSession, Proof

ON_FAILURE = ("raise", "skip")
"""What a Recorder does when a step fails: raise (write the bundle and stop), or try to skip the proven culprits."""
GUIDE = "docs/guide/skip-bad-samples.md"
CAUGHT_BY_THE_CALLER = ("the exception was handed to end_step(exc=...): the framework's loop it came from has already "
                        "ended, so the step cannot go on (only Recorder.step can skip a step that raised)")
TEAM_GRACE_S = 30.0
"""Under torch.distributed, how much longer than ``skip_budget_s`` a rank waits for the rank leading a phase."""


@dataclass(kw_only=True, slots=True)
class SkipSettings:
    """The ``on_failure`` options of a :class:`reprokit.Recorder`, checked once at attach time."""

    on_failure: str = "raise"
    """``"raise"``: a failure writes its bundle and stops the run. ``"skip"``: then tries to skip proven culprits."""
    skip_budget_s: float = 120.0
    """Wall-clock seconds one attempt may spend replaying; past it, the run stops as with ``"raise"``."""
    max_skips: int = 3
    """At most this many skips within any ``skip_window`` consecutive steps; one more stops the run."""
    skip_window: int = 1000
    """The span of steps ``max_skips`` counts over."""
    skip_indices: frozenset[Any] = frozenset()
    """Dataset indices whose rows are dropped from every batch before it is recorded and trained on."""

    def __post_init__(self) -> None:
        if self.on_failure not in ON_FAILURE:
            raise ConfigError.option("on_failure", f"{{opt}} must be one of {', '.join(map(repr, ON_FAILURE))}, got "
                                                   f"{self.on_failure!r}")
        budget = self.skip_budget_s
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget <= 0:
            raise ConfigError.option("skip_budget_s", f"{{opt}} must be a positive number of seconds, got {budget!r}")
        for name in ("max_skips", "skip_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError.option(name, f"{{opt}} must be an integer >= 1, got {value!r}")
        bad = [i for i in self.skip_indices if isinstance(i, bool) or not isinstance(i, (int, str))]
        if bad:
            raise ConfigError.option("skip_indices", f"{{opt}} holds dataset indices: ints (or strings, for string "
                                                     f"ids); got {bad[0]!r}")


@dataclass
class Attempt:
    """The outcome of one failure under ``on_failure="skip"``."""

    skipped: bool
    value: Any = None
    """For a skip: what the step function returned on the batch without the culprit rows."""
    note: str | None = None
    """For no skip: why not (added to the raised error)."""
    entry: dict[str, Any] | None = None
    """For a skip: the journal entry."""


# --- the recorder's side --------------------------------------------------------------------


def _go(got: dict[int, Any] | None, wait: float) -> str:
    """``"go"`` when every rank can roll back to the same step, else why not (the words every rank's note gives)."""
    if got is None:
        return (f"a rank did not say within {wait:.0f} s whether it can roll back (one that did not fail itself, or "
                "one stuck in a collective): every rank stops")
    whys = [v["why"] for v in got.values() if v.get("why")]
    if whys:
        return "; ".join(whys) + ": every rank stops"
    for key, what in (("step", "failed at different steps"), ("start", "have windows that start at different steps")):
        values = {r: v.get(key) for r, v in got.items()}
        if len(set(values.values())) > 1:
            return f"the ranks {what} ({values}): they cannot roll back together"
    raised = [r for r, v in got.items() if v.get("kind") == FailureKind.EXCEPTION.value]
    if raised:
        return (f"rank(s) {raised} failed with an exception: replaying it may leave the other ranks waiting in a "
                "collective, so every rank stops")
    return "go"


def refuse_skip(options: dict[str, Any], framework: str) -> None:
    """A framework callback's check of its Recorder options: ``on_failure="skip"`` needs a step function that replays
    an edited batch on the live trainer without moving the framework's own counters, which the Lightning callback
    does not have yet. Refused at construction, never at the failure."""
    value = options.get("on_failure", "raise")
    if value != "raise":
        SkipSettings(on_failure=value)  # an unknown value is refused as the Recorder refuses it
        raise ConfigError.option("on_failure", f"{{opt}}={value!r} is not supported through the {framework} callback "
                                               "yet: the callback records, and a failure stops training as with "
                                               f"{{opt}}=\"raise\" (the default). See {GUIDE}")


class Skipper:
    """A Recorder's ``on_failure`` machinery: its settings, the steps skipped so far and the journal."""

    def __init__(self, settings: SkipSettings, out_dir: Path):
        self.settings = settings
        self.journal = Path(out_dir) / JOURNAL
        self.skipped: deque[int] = deque()
        """Steps skipped by this Recorder, oldest first (the limit counts those within ``skip_window``)."""
        self.exceptions_end_the_loop: str | None = None
        """Why a failure that raised cannot be skipped now: set by :meth:`Recorder.end_step` while it judges an
        exception a framework caught (its loop has already left the step, so the step cannot go on)."""
        self._filter_warned = False

    @property
    def on(self) -> bool:
        return self.settings.on_failure == "skip"

    # --- skip_indices ---

    def filter(self, batch: Any, step: int) -> Any:
        """``batch`` without its rows whose dataset index is in ``skip_indices`` (the batch itself when there are
        none, or when it names no dataset index: said once)."""
        drop = self.settings.skip_indices
        if not drop:
            return batch
        values = _index_values(batch)
        if values is None:
            if not self._filter_warned:
                self._filter_warned = True
                _warn(f"reprokit: skip_indices is set, but the batch of step {step} carries no dataset index (a leaf "
                      "named 'index', 'indices', 'idx' or 'sample_id', one per row), so no row can be dropped; filter "
                      f"the indices out of your sampler instead ({GUIDE})")
            return batch
        n, idx = values
        keep = [i for i, v in enumerate(idx) if v not in drop]
        if len(keep) == n:
            return batch
        from reprokit.shrink.batch import select_rows

        return select_rows(batch, n, keep)

    # --- on a failure ---

    def after_failure(self, rec: Recorder, failure: Failure, record: Any, bundle: Path | None) -> Attempt:
        """The step ``failure.step`` failed and its bundle is written (``bundle``; None if it could not be): skip its
        proven culprit rows and continue, or say why not. Never raises (but ``BaseException``)."""
        from reprokit.distributed.team import TeamLost
        from reprokit.skip_proof import Clock, OutOfTime, Refused  # torch-heavy: loaded at a failure only

        k = failure.step
        clock = Clock(self.settings.skip_budget_s)
        try:
            proof, session = self._attempt(rec, failure, record, bundle, clock)
        except Refused as r:
            return Attempt(False, note=self._no_skip(k, r.reason, str(r), clock))
        except OutOfTime:
            return Attempt(False, note=self._no_skip(k, "budget", f"the replays took longer than skip_budget_s="
                                                     f"{self.settings.skip_budget_s:g} s", clock))
        except TeamLost as e:
            return Attempt(False, note=self._no_skip(k, "distributed", f"the ranks lost each other: {e}", clock))
        except Exception as e:  # a fault of the attempt itself: the run stops as it would have
            return Attempt(False, note=self._no_skip(k, "error", f"the attempt failed: {e!r}", clock))
        return self._skipped(rec, failure, record, bundle, proof, session, clock)

    def decline(self, rec: Recorder, failure: Failure) -> None:
        """Under torch.distributed, a rank that does not skip (``on_failure="raise"``) says so where ranks that do
        wait for every rank's word (:meth:`_together`): they stop at once with the reason, rather than after
        ``incident_wait_s`` of silence (by when the launcher may have ended them). Never raises."""
        board, info = rec._board, rec.rank
        if board is None or info is None or board.current is None:
            return
        try:
            from reprokit.distributed.team import Team

            folder = board.path.with_name(f"{info.run_key}.{board.current['number']}.skip")
            Team(folder, info.rank, list(range(info.world_size)), 0.0).say("ready", {
                "why": f"rank {info.rank} does not skip failures (its Recorder has on_failure=\"raise\")",
                "step": failure.step, "start": rec._snapshot.step if rec._snapshot else None,
                "kind": FailureKind(failure.kind).value})
        except Exception as e:
            _warn(f"reprokit: cannot tell the other ranks that rank {info.rank} does not skip ({e!r})")

    def _attempt(self, rec: Recorder, failure: Failure, record: Any, bundle: Path | None,
                 clock: Clock) -> tuple[Proof, LiveSession]:
        from reprokit.skip_proof import prove, prove_together

        if rec._board is None:
            self._admit(rec, failure, record)
            session, inputs = self._prepare(rec, failure, bundle)
            team = None
        else:  # every rank, or none: see _together
            team, session, inputs = self._together(rec, failure, record, bundle)
        recorded = {r.step: r.loss for r in rec._ring}
        rec.detach()  # the recorder's hooks stay off the optimizer while the replays step it
        try:
            if team is None:
                return prove(session, inputs, clock, recorded=recorded), session
            return prove_together(session, inputs, clock, team, recorded=recorded), session
        finally:
            session.close()
            rec.attach()

    def _prepare(self, rec: Recorder, failure: Failure, bundle: Path | None) -> tuple[LiveSession, list[Any]]:
        """The replay session over the live job and the window's inputs (nothing replayed yet)."""
        from reprokit.skip_proof import LiveSession, snapshot_of, window_inputs

        snapshot = snapshot_of(rec, bundle)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # every batch copy of the window has landed
        session = LiveSession(rec, failure, snapshot, bundle)
        return session, window_inputs(rec._ring, session.device)

    def _together(self, rec: Recorder, failure: Failure, record: Any,
                  bundle: Path | None) -> tuple[Team, LiveSession, list[Any]]:
        """Under torch.distributed: every rank says whether it can roll back to the same step (its window complete in
        memory, its own failure at the same step), and one decision, the first written, holds for all (see
        :meth:`Team.decide`): a rank stuck in a collective never says, so after ``incident_wait_s`` the others stop."""
        from reprokit.distributed.team import Team
        from reprokit.skip_proof import Refused

        board, info = rec._board, rec.rank
        assert board is not None and info is not None and board.current is not None
        why, prepared = None, None
        try:
            self._admit(rec, failure, record)
            missing = sorted(set(range(info.world_size)) - set(board.recording_ranks()))
            if missing:
                raise Refused("distributed", f"ranks {missing} record nothing, so they cannot replay with the others")
            prepared = self._prepare(rec, failure, bundle)
        except Refused as r:
            why = f"rank {info.rank} cannot roll back ({r.reason}): {r}"
        except Exception as e:
            why = f"rank {info.rank} cannot roll back: {e!r}"
        folder = board.path.with_name(f"{info.run_key}.{board.current['number']}.skip")
        wait = min(rec.incident_wait_s, self.settings.skip_budget_s)
        team = Team(folder, info.rank, list(range(info.world_size)), wait)
        mine = {"why": why, "step": failure.step, "start": rec._snapshot.step if rec._snapshot else None,
                "kind": FailureKind(failure.kind).value}
        got = team.gather("ready", mine)
        decision = team.decide("go", _go(got, wait), got)
        if decision != "go" or prepared is None:
            if prepared is not None:
                prepared[0].close()
            raise Refused("distributed", str(decision))
        team.timeout_s = self.settings.skip_budget_s + TEAM_GRACE_S  # the leading rank stops at its budget
        return team, *prepared

    def _admit(self, rec: Recorder, failure: Failure, record: Any) -> None:
        """What is checked before any replay: the kind of failure, the limit, a complete window in memory."""
        from reprokit.skip_proof import Refused

        k = failure.step
        if failure.kind in DEATHS or failure.kind == FailureKind.PEER:
            raise Refused("kind", f"a {failure.kind} failure is not replayed in the training process")
        if failure.kind == FailureKind.EXCEPTION and self.exceptions_end_the_loop:
            raise Refused("kind", self.exceptions_end_the_loop)
        window = self.settings.skip_window
        recent = [s for s in self.skipped if s > k - window]
        if len(recent) >= self.settings.max_skips:
            raise Refused("limit", f"max_skips={self.settings.max_skips} skips within skip_window={window} steps are "
                                   f"used up (steps {recent})")
        engine = rec._engine
        if record is None or not rec._ring or rec._ring[-1] is not record or not rec._window_ok or \
                rec._snapshot is None or engine.broken or engine.torn:
            raise Refused("window", f"the window of step {k} is not complete in memory (see the recorder's warnings)")

    def _skipped(self, rec: Recorder, failure: Failure, record: Any, bundle: Path | None, proof: Proof,
                 session: LiveSession, clock: Clock) -> Attempt:
        k = failure.step
        indices = proof.indices
        loss = proof.without.losses.get(k)
        # The job goes on from the state the last run left; the recorder's own bookkeeping follows it.
        rec.monitor.load_state_dict(session.monitor.state_dict())
        if rec._history and rec._history[-1][0] == k:
            old = rec._history[-1]
            rec._history[-1] = (k, loss, None, old[3], old[4])
        if record is not None:
            record.loss = loss
        rec._resnap = True  # the window restarts at the next step, from the state the run goes on with
        self.skipped.append(k)
        value = session.value
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value = value.detach()
        if not proof.rows:  # a rank that rolled back with another rank's skip: nothing of its own to journal
            culprits = (proof.evidence.get("ranks") or {}).get("culprits") or {}
            rec._warn("", f"reprokit: rank {rec.rank.rank if rec.rank else '?'}: step {k} failed "
                          f"({failure.describe()}); rank(s) {', '.join(culprits)} skipped their proven culprit rows, "
                          f"and this rank replayed the window with them ({clock.seconds:.1f} s); training goes on")
            return Attempt(True, value=value)
        incident = rec._board.current.get("incident") if rec._board is not None and rec._board.current else None
        entry = {
            "format": JOURNAL_FORMAT, "version": JOURNAL_VERSION, "reprokit": __version__,
            "time": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "step": k, "rank": rec.rank.rank if rec.rank is not None else None, "incident": incident,
            "rows": proof.rows, "dataset_indices": indices,
            "failure": failure.summary(), "evidence": proof.evidence,
            "seconds_lost": round(clock.seconds, 3), "bundle": str(bundle) if bundle else None,
        }
        try:
            append_entry(self.journal, entry)
        except OSError as e:
            rec._warn("", f"reprokit: could not write to {self.journal} ({e!r}); the skip of step {k} is not in the "
                          "journal")
        named = f"dataset indices {indices}" if indices is not None else f"rows {proof.rows} (no dataset index leaf)"
        who = f"rank {rec.rank.rank}: " if rec.rank is not None else ""
        rec._warn("", f"reprokit: {who}step {k} failed ({failure.describe()}); skipped {named} after proving them the "
                      f"cause in {clock.seconds:.1f} s of replays, and training goes on. Bundle: {bundle}; journal: "
                      f"{self.journal}")
        return Attempt(True, value=value, entry=entry)

    def _no_skip(self, step: int, reason: str, why: str, clock: Clock) -> str:
        return (f"reprokit: did not skip step {step} ({reason}): {why.rstrip('.')}. on_failure=\"skip\" skips only "
                f"rows it proves to be the cause ({clock.seconds:.1f} s spent; see {GUIDE})")


def _index_values(batch: Any) -> tuple[int, list[Any]] | None:
    """``(rows, each row's dataset index)`` of a batch that carries an index leaf of one value per row."""
    from reprokit.shrink import micro
    from reprokit.shrink.batch import batch_size, dataset_indices

    if micro.layout(batch) is not None:
        return None
    n = batch_size(batch)
    if not n:
        return None
    values = dataset_indices(batch, tuple(range(n)))
    return (n, values) if values is not None and len(values) == n else None


def _warn(message: str) -> None:
    try:
        warnings.warn(message, RecorderWarning, stacklevel=4)
    except Exception:  # warnings turned into errors: never raise into the training loop
        print(message, file=sys.stderr)


def as_indices(values: Iterable[Any] | torch.Tensor | None) -> frozenset[Any]:
    """``skip_indices`` as a set: a list, a set, a tensor or numpy array of indices (None: none)."""
    if values is None:
        return frozenset()
    if hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, Iterable) or isinstance(values, (str, bytes)):
        raise ConfigError.option("skip_indices", f"{{opt}} must be a collection of dataset indices, got {values!r}")
    return frozenset(values)
