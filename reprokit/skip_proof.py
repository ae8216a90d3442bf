"""The replays behind ``on_failure="skip"``: a replay session over the running job itself, and the evidence rule
(:func:`prove`). Loaded only when a failure is to be skipped (see :mod:`reprokit.skip`)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from reprokit import pytree
from reprokit.bundle import Bundle, open_bundle
from reprokit.detect import Monitor
from reprokit.replayer import RunOutcome, Session, StepInput, _fresh_batch
from reprokit.rng import encode as encode_rng
from reprokit.shrink import micro
from reprokit.shrink.batch import batch_size, dataset_indices, mask_rows, mix_rows, select_rows
from reprokit.shrink.case import Case, what_happened
from reprokit.shrink.culprit import STATE, StateCheck, check_state
from reprokit.shrink.shrinker import Shrinker
from reprokit.signature import Failure
from reprokit.state import volatile_buffers

if TYPE_CHECKING:
    from reprokit.distributed.team import Team
    from reprokit.record import Recorder


class Refused(Exception):
    """Internal: the evidence for a skip does not hold; ``reason`` is a short code, the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class OutOfTime(Exception):
    """Internal: the attempt's ``skip_budget_s`` is spent."""


class Clock:
    """The attempt's wall-clock budget: :meth:`check` raises :class:`OutOfTime` once it is spent (the shrinker calls
    it after each candidate, as its progress callback)."""

    def __init__(self, budget_s: float):
        self.start = time.monotonic()
        self.deadline = self.start + budget_s

    def check(self, *_: Any) -> None:
        if time.monotonic() > self.deadline:
            raise OutOfTime

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.start


@dataclass
class Proof:
    """What :func:`prove` established: the culprit rows and the evidence, and the run that continues the job."""

    rows: list[Any]
    """The culprit rows of the failing batch: positions, or ``(micro-batch, row)`` pairs."""
    indices: list[Any] | None
    """Their dataset indices (None: the batch carries no index leaf)."""
    evidence: dict[str, Any]
    without: RunOutcome
    """The failing step run without the culprit rows: the live state is the one it left."""


@dataclass
class _Window:
    """What a :class:`Session` reads of its bundle, for a window held in this process's memory."""

    failure: Failure
    path: Path | None
    run: dict[str, Any] = field(default_factory=dict)
    env: dict[str, Any] = field(default_factory=dict)


class LiveSession(Session):
    """A replay :class:`Session` over the running job itself: its live state, step function and detector settings,
    the Recorder's in-memory snapshot and window. Nothing is built or imported; every restore writes into the live
    model, optimizer, scheduler, scaler and generators (which is how the job goes on from the last run).

    Batches keep the device each tensor was recorded from (a CUDA batch is on the model's device again), where a
    bundle's replay moves every tensor to one device.
    """

    def __init__(self, rec: Recorder, failure: Failure, snapshot: tuple[dict, dict], bundle: Path | None):
        # Not Session.__init__: that one loads a bundle, imports its code and calls build().
        state = rec.state
        self.bundle = cast(Bundle, _Window(failure, bundle))
        self.state = state
        self.recorded = failure
        self.device = next((p.device for p in state.model.parameters()), torch.device("cpu"))
        self.user_code = self.code_dir = None
        self.code_label = "the running job's own code"
        self._preload_on, self._preload, self._steps_ahead, self._code_copy = False, None, None, None
        self._stack = ExitStack()
        self.on_step = None
        self.after_restore = []
        # Non-persistent buffers are in no snapshot the Recorder takes: each restore puts back what they hold now.
        self._built_buffers = {k: v.detach().to("cpu", copy=True) for k, v in volatile_buffers(state.model).items()}
        self.snapshot = snapshot
        self.value: Any = None
        """What the step function returned in the last step run."""
        train_step = rec.train_step

        def step(st: Any, batch: Any) -> Any:
            self.value = train_step(st, batch)
            return self.value

        self.step_fn = step
        self.monitor = Monitor(state, rec.settings, rec.monitor.predicates)
        self.monitor.replaying = True
        self.runs = self.steps_run = 0
        self.last: RunOutcome | None = None
        self.mirror: Team | None = None
        """Under torch.distributed, while this rank leads a phase: each run is announced to the other ranks first, which
        run their own batch of the same step alongside (the model's collectives need every rank)."""

    def fresh_batch(self, batch: Any) -> Any:
        return _fresh_batch(batch, None)

    def capture(self, copy: Any = None) -> tuple[dict, dict[str, torch.Tensor]]:
        """The live state as a snapshot (the state before the failing step, which every replay of that step
        restores). Where the model is on a GPU with room for another copy of its state, the copy stays there: a
        restore is then a device-to-device copy instead of the whole state from pageable host memory (about 1.5 s
        a replay on GPT-2 124M; a skip runs a dozen or more). Else in host memory, as a bundle's replay keeps it."""
        return super().capture(copy if copy is not None else _on_device_copy(self.state, self.device))

    def run(self, steps: Sequence[StepInput], snapshot: tuple[dict, dict] | None = None,
            restore: bool = True) -> RunOutcome:
        if self.mirror is not None:
            if len(steps) != 1 or not restore:
                raise RuntimeError("a run the other ranks cannot mirror: they run the failing step alone")
            self.mirror.post("lead", {"run": steps[0].step})
        out = super().run(steps, snapshot, restore)
        self.runs += 1
        self.steps_run += len(out.losses)
        self.last = out
        return out

    def close(self) -> None:
        self.monitor.close()


ROOM_MARGIN = 1 << 30
"""GPU memory left free beyond a device copy of the state, for the replays' own activations."""


def _on_device_copy(state: Any, device: torch.device) -> Any:
    """A copy function that clones each tensor where it is (``device``'s stay on the GPU), or None (host copies)
    where ``device`` is no GPU or its free memory is short of the state's bytes plus :data:`ROOM_MARGIN`."""
    if device.type != "cuda":
        return None
    def size(ts: Any) -> int:
        return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor) and t.device == device)

    # The copy holds the model, the optimizer state and any gradients; a restore clones the optimizer state again.
    opt = size(v for st in state.optimizer.state.values() for v in st.values())
    need = size(state.model.state_dict().values()) + 2 * opt + size(p.grad for p in state.model.parameters())
    try:
        free, _ = torch.cuda.mem_get_info(device)
    except Exception:
        return None
    if free < need + ROOM_MARGIN:
        return None
    return lambda t: t.detach().clone(memory_format=torch.contiguous_format)


def window_inputs(ring: Sequence[Any], device: torch.device) -> list[StepInput]:
    """The Recorder's window as replay inputs. A batch tensor copied from a CUDA tensor (into a pinned buffer) goes
    back to ``device``; the others stay on the host, as they were recorded."""
    out = []
    for rec in ring:
        tensors = {k: t.to(device) if device.type == "cuda" and t.is_pinned() else t for k, t in rec.tensors.items()}
        rng_tree, rng_tensors = encode_rng(rec.rng)
        out.append(StepInput(rec.step, pytree.decode(rec.batch, tensors), rng_tree, rng_tensors))
    return out


def prove(session: LiveSession, inputs: Sequence[StepInput], clock: Clock, *, recorded: dict[int, Any] | None = None,
          pad_id: int = 0) -> Proof:
    """Decide, by replays in ``session``, whether rows of the last input's batch caused its failure (the evidence
    rule of the module docstring). On success the live state is the failing step's without the culprit rows.

    Raises:
        Refused: the evidence does not hold, saying which part and why.
        OutOfTime: ``clock`` ran out.
    """
    last, k = inputs[-1], inputs[-1].step
    cut = Rows(last.batch)
    original = Case(tuple(inputs), session.snapshot, 0, cut.units, None)
    sh = Shrinker(session, budget=1 << 30, pad_id=pad_id, progress=clock.check)
    before = sh.snapshot_at(original, len(inputs) - 1)  # the one window replayed
    if before is None:
        got = session.last.failure.describe() if session.last and session.last.failure else "a failure"
        raise Refused("not_reproduced", f"replaying the window from its snapshot, an earlier step failed ({got})")
    exact = _bit_exact(session.last, recorded or {})
    clock.check()
    suffix = Case((last,), before[0], before[1], cut.units, None)
    if not sh.test(suffix):
        raise Refused("not_reproduced", f"replayed from the snapshot, step {k} did not fail the same way: "
                                        f"{what_happened(sh.outcome(suffix))}")
    sh.arm(suffix, len(cut.units))
    missed = sh.confirm(suffix, 1)
    if missed:
        raise Refused("flaky", f"step {k} failed the same way on one replay but not on the next ({missed})")
    clock.check()
    checked = check_state(sh, original)
    if checked.verdict == STATE:
        raise Refused("state", f"no rows to blame: {checked.message}")
    clock.check()
    rows = _culprit_rows(sh, suffix, cut)
    only, background = _only(sh, suffix, cut, _donor(checked, inputs), rows, pad_id)
    if not only[0]:
        raise Refused("evidence", f"step {k} on a batch holding only rows {rows} (the others {background}) did not "
                                  f"fail the same way: {what_happened(only[1])}")
    clock.check()
    without = session.run([StepInput(k, cut.without(rows), last.rng, last.rng_tensors)], before[0])
    if without.failure is not None:
        raise Refused("evidence", f"step {k} without rows {rows} still failed: {without.failure.describe()}")
    evidence = {
        "window": {"from_step": inputs[0].step, "to_step": k, "replayed_bit_exact": exact},
        "reproduced": "the failing step failed the same way on 2 of 2 runs",
        "state_check": checked.to_json(),
        "culprit_search": {"pass": "rows", "candidates": sh.replays, "different_failures": sh.different_failures,
                           "origin": sh.origin.to_json() if sh.origin else None},
        "without_culprits": {"verdict": "passed", "rows": len(cut.units) - len(rows), "loss": without.losses.get(k)},
        "only_culprits": {"verdict": "same failure", "background": background},
        "replays": session.runs,
        "steps_run": session.steps_run,
    }
    return Proof(rows, cut.indices(rows), evidence, without)


class Rows:
    """The rows of a failing batch and how to cut it: positions along dim 0, or ``(micro-batch, row)`` pairs for a
    batch of micro-batches (:mod:`reprokit.shrink.micro`), as shrink's rows pass names them.

    Raises:
        Refused: the batch's rows cannot be told, or it has fewer than two.
    """

    def __init__(self, batch: Any):
        self.batch = batch
        self.lay = micro.layout(batch)
        if self.lay is None:
            why = micro.ambiguous(batch)
            if why:
                raise Refused("batch", why)
            self.units: tuple[Any, ...] = tuple(range(batch_size(batch) or 0))
        else:
            self.units = micro.units(batch, self.lay)
        if len(self.units) < 2:
            raise Refused("batch", "the failing batch has fewer than two rows, so no row can be left out of it")

    def keep(self, rows: Sequence[Any]) -> Any:
        """The batch with only ``rows``, in their order."""
        if self.lay is None:
            return select_rows(self.batch, len(self.units), list(rows))
        out = micro.select(self.batch, self.lay, self.units, list(rows))
        if out is None:
            raise Refused("batch", f"the batch cut to rows {list(rows)} cannot be built (its micro-batches would differ "
                                   "in size)")
        return out

    def without(self, rows: Sequence[Any]) -> Any:
        gone = set(rows)
        return self.keep([u for u in self.units if u not in gone])

    def only(self, rows: Sequence[Any], donor: Any | None, pad_id: int) -> tuple[Any, str]:
        """A batch of the failing one's shapes holding ``rows`` in their places and ``donor``'s rows elsewhere (a
        batch of the same shapes that passed), else the other rows masked; and which it was."""
        if self.lay is None:
            n = len(self.units)
            mixed = mix_rows(self.batch, donor, n, list(rows)) if donor is not None else None
            return (mixed, "donor") if mixed is not None else (mask_rows(self.batch, n, list(rows), pad_id), "masked")
        micros = micro.split(self.batch, self.lay)
        donors = micro.split(donor, self.lay) if donor is not None and micro.layout(donor) == self.lay else None
        if donors is not None and len(donors) != len(micros):
            donors = None
        parts, how = [], "donor" if donors is not None else "masked"
        for i, m in enumerate(micros):
            mine = [r for k, r in rows if k == i]
            n = batch_size(m) or 0
            part = mix_rows(m, donors[i], n, mine) if donors is not None else None
            if part is None:
                part, how = mask_rows(m, n, mine, pad_id), "masked"
            parts.append(part)
        joined = micro.join(self.batch, self.lay, parts)
        if joined is None:
            raise Refused("batch", "the micro-batches with only the culprit rows cannot be built")
        return joined, how

    def indices(self, rows: Sequence[Any]) -> list[Any] | None:
        """The dataset indices of ``rows`` (None: the batch carries no index leaf)."""
        if self.lay is None:
            return dataset_indices(self.batch, tuple(rows))
        return micro.indices(self.batch, self.lay, tuple(rows))


def _bit_exact(out: RunOutcome | None, recorded: dict[int, Any]) -> bool | None:
    """Whether the replayed losses before the failing step are the recorded ones, bit for bit (None: none to
    compare)."""
    if out is None:
        return None
    pairs = [(recorded[s], v) for s, v in out.losses.items() if recorded.get(s) is not None and v is not None]
    if not pairs:
        return None
    return all(a == b or (math.isnan(a) and math.isnan(b)) for a, b in pairs)


def _culprit_rows(sh: Shrinker, suffix: Case, cut: Rows) -> list[Any]:
    """The rows pass, on the failing step alone, repeated on the rows it leaves while they still fail the same way
    (two bad samples in one batch: each fails alone, the first search finds one)."""
    found: list[Any] = []
    case = suffix
    while True:
        sh.best = case  # the scheduler works on its best case: this one
        best, _, exhausted = sh.run(case, ("rows",))
        if exhausted:
            raise OutOfTime
        kept = list(best.rows or ())
        if not kept or len(kept) >= len(case.rows or ()):
            what = "the failure needs every row of the batch" if not found else \
                f"the rows left after {sorted(found)} still fail together, and no smaller set of them does"
            raise Refused("no_culprit", f"no smaller set of rows fails alone: {what}")
        found += kept
        rest = [u for u in cut.units if u not in found]
        if not rest:
            raise Refused("no_culprit", "every row of the batch fails alone")
        case = suffix.with_last(cut.keep(rest), rows=tuple(rest))
        if not sh.test(case):
            return sorted(found)


def _only(sh: Shrinker, suffix: Case, cut: Rows, donor: StepInput | None, rows: list[Any],
          pad_id: int) -> tuple[tuple[bool, Any], str]:
    """Judge the failing step on a batch of its shapes holding only the culprit rows: the others from ``donor`` (a
    batch that passed the failing step from the same state), else masked."""
    last = suffix.last
    batch, how = cut.only(rows, donor.batch if donor is not None else None, pad_id)
    background = f"rows of step {donor.step}'s batch, which passed" if how == "donor" and donor is not None else \
        "masked to 0 / the pad id"
    case = Case((StepInput(last.step, batch, last.rng, last.rng_tensors),), suffix.snapshot, suffix.snap_id,
                cut.units, None)
    return sh._judge(case), background


def _donor(checked: StateCheck, inputs: Sequence[StepInput]) -> StepInput | None:
    """The other step's batch the state check ran that passed (None: none did)."""
    passed = [t["batch_of"] for t in checked.tried if t.get("result") == "it passed"]
    return next((inp for inp in inputs if passed and inp.step == passed[0]), None)


def snapshot_of(rec: Recorder, bundle: Path | None) -> tuple[dict, dict]:
    """The window's snapshot: the Recorder's in memory; one spilled to disk or referencing rank 0's state is read
    back from the bundle just written."""
    snap = rec._snapshot
    assert snap is not None
    if isinstance(snap.tensors, dict) and not snap.referenced:
        return snap.tree, snap.tensors
    if bundle is None:
        raise Refused("window", "the snapshot is not in host memory (spilled or referenced) and no bundle holds it")
    return open_bundle(bundle).state()


# --- several ranks ------------------------------------------------------------------------------------------------


def _verdict(out: RunOutcome) -> str:
    """A run in one word, for the other ranks: ``same`` (this rank's recorded failure), ``passed`` or ``other``."""
    return "same" if out.same else "passed" if out.failure is None else "other"


def _ranks_where(verdicts: dict[int, str], word: str) -> list[int]:
    return [r for r, v in verdicts.items() if v == word]


def prove_together(session: LiveSession, inputs: Sequence[StepInput], clock: Clock, team: Team, *,
                   recorded: dict[int, Any] | None = None, pad_id: int = 0) -> Proof:
    """:func:`prove` for every rank of a process group at once: the same evidence, each rank replaying its own window
    in step with the others (the model's collectives run in every replay), each decision taken from what every rank
    saw (:class:`reprokit.distributed.team.Team`):

    1. every rank replays its window up to the failing step; every rank's failing step fails the way it recorded,
       twice;
    2. every rank running a healthy batch of its own window (the same on every rank: the nearest earlier step whose
       batch has the failing one's shapes) passes: the state is sound;
    3. a rank holds culprit rows when it alone keeps its failing batch (the others run their healthy one) and its
       failure comes back;
    4. on each such rank, the rows pass finds its culprits, that rank leading and the others running their healthy
       batch alongside each candidate; with only them (in the rank's healthy batch) it fails the same way;
    5. every rank runs the failing step again, the culprit ranks without their culprit rows, the others with their own
       batch: every rank passes. The job goes on from there on every rank.

    Returns this rank's proof (``rows`` empty on a rank without culprits).
    """
    last, k = inputs[-1], inputs[-1].step
    me = team.rank
    original = Case(tuple(inputs), session.snapshot, 0, None, None)
    sh = Shrinker(session, budget=1 << 30, pad_id=pad_id, progress=clock.check)
    before = sh.snapshot_at(original, len(inputs) - 1)
    _all_or_stop(team.exchange("window", before is not None), True, "not_reproduced",
                 "replaying the window, a step before the failing one failed on rank(s) {ranks}")
    assert before is not None
    exact = _bit_exact(session.last, recorded or {})
    for word, reason in (("reproduced", "not_reproduced"), ("confirmed", "flaky")):
        got = team.exchange(word, _verdict(session.run([last], before[0])))
        _all_or_stop(got, "same", reason, f"step {k} did not fail the way it was recorded on rank(s) {{ranks}} "
                                          f"({'first' if word == 'reproduced' else 'second'} replay: {got})")
    healthy_of, healthy = _healthy_together(session, team, inputs, before[0])
    culprits = []
    for r in team.ranks:  # which ranks' data: each alone keeps its failing batch
        got = team.exchange(f"rank{r}-alone", _verdict(session.run([last if me == r else healthy], before[0])))
        if got[r] == "same":
            culprits.append(r)
        clock.check()
    if not culprits:
        raise Refused("no_culprit", f"no rank's batch fails alone (the others on healthy data): the failure at step {k} "
                                    "needs the data of several ranks together")
    rows_of: dict[int, list[Any]] = {}
    backgrounds: dict[int, str] = {}
    for r in culprits:
        if me == r:
            rows_of[r], backgrounds[r] = _lead(session, team, last, (healthy_of, healthy), before, clock, pad_id)
        else:
            end = _follow(session, team, r, healthy, before[0])
            rows_of[r], backgrounds[r] = end["rows"], end["background"]
    mine = [tuple(u) if isinstance(u, list) else u for u in rows_of.get(me, [])]  # pairs come back as lists
    batch = Rows(last.batch).without(mine) if mine else last.batch
    without = session.run([StepInput(k, batch, last.rng, last.rng_tensors)], before[0])
    got = team.exchange("without", _verdict(without))
    _all_or_stop(got, "passed", "evidence", f"step {k} without the culprit rows {rows_of} still failed on rank(s) "
                                            "{ranks}")
    evidence = {
        "window": {"from_step": inputs[0].step, "to_step": k, "replayed_bit_exact": exact},
        "reproduced": "the failing step failed the way it was recorded on every rank, on 2 of 2 runs",
        "state_check": {"verdict": "data", "healthy_batch_of": healthy_of,
                        "message": f"every rank passed step {k} on its own batch of step {healthy_of}"},
        "ranks": {"rolled_back": team.ranks, "culprits": {str(r): rows_of[r] for r in culprits}},
        "without_culprits": {"verdict": "passed", "rows": _count_rows(batch), "loss": without.losses.get(k),
                             "on_every_rank": True},
        "only_culprits": {"verdict": "same failure", "background": backgrounds.get(me) or "(no culprit on this rank)"},
        "replays": session.runs,
        "steps_run": session.steps_run,
    }
    return Proof(mine, Rows(last.batch).indices(mine) if mine else None, evidence, without)


def _count_rows(batch: Any) -> int:
    lay = micro.layout(batch)
    return len(micro.units(batch, lay)) if lay is not None else batch_size(batch) or 0


def _all_or_stop(got: dict[int, Any], want: Any, reason: str, message: str) -> None:
    off = [r for r, v in got.items() if v != want]
    if off:
        raise Refused(reason, message.format(ranks=off))


def _healthy_together(session: LiveSession, team: Team, inputs: Sequence[StepInput],
                      before: tuple[dict, dict]) -> tuple[int, StepInput]:
    """The batch of an earlier step every rank passes the failing step on, from the state before it (the state check
    of shrink, on every rank at once: the k-th try swaps in every rank's k-th nearest batch of the same shapes): that
    step, and the failing step's input with that batch."""
    from reprokit.shrink.culprit import SUBSTITUTES, _shape

    last, k = inputs[-1], inputs[-1].step
    shape = _shape(last.batch)
    others = [inp for inp in reversed(inputs[:-1]) if _shape(inp.batch) == shape][:SUBSTITUTES]
    tries = min(team.exchange("substitutes", len(others)).values())
    if not tries:
        raise Refused("no_culprit", "a rank's window holds no other batch of its failing batch's shapes, so whether the "
                                    "state fails on any data could not be tested")
    for i in range(tries):
        swapped = StepInput(k, others[i].batch, last.rng, last.rng_tensors)
        got = team.exchange(f"healthy{i}", _verdict(session.run([swapped], before)))
        if all(v == "passed" for v in got.values()):
            return others[i].step, swapped
    raise Refused("state", f"no rows to blame: every rank ran step {k} on {tries} of its earlier batches in place "
                           "of its own, and the failure came back each time: the cause is upstream of the data (weights, "
                           "LR, optimizer state)")


def _lead(session: LiveSession, team: Team, last: StepInput, healthy: tuple[int, StepInput], before: tuple[Any, ...],
          clock: Clock, pad_id: int) -> tuple[list[Any], str]:
    """This rank holds culprits: search its rows (every run announced; the others run their healthy batch alongside),
    then tell them what it found, or that it stops."""
    session.mirror = team
    try:
        cut = Rows(last.batch)
        sh = Shrinker(session, budget=1 << 30, pad_id=pad_id, progress=clock.check)
        suffix = Case((last,), before[0], before[1], cut.units, None)
        if not sh.test(suffix):
            raise Refused("flaky", f"step {last.step} with only this rank's data failed, then did not: "
                                   f"{what_happened(sh.outcome(suffix))}")
        sh.arm(suffix, len(cut.units))
        rows = _culprit_rows(sh, suffix, cut)
        donor = StepInput(healthy[0], healthy[1].batch, last.rng, last.rng_tensors)
        only, background = _only(sh, suffix, cut, donor, rows, pad_id)
        if not only[0]:
            raise Refused("evidence", f"step {last.step} on a batch holding only rows {rows} (the others {background}) "
                                      f"did not fail the same way: {what_happened(only[1])}")
    except Refused as r:
        session.mirror = None
        team.post("lead", {"end": {"stop": str(r), "reason": r.reason}})
        raise
    except OutOfTime:
        session.mirror = None
        team.post("lead", {"end": {"stop": "the leading rank's replays took longer than skip_budget_s",
                                   "reason": "budget"}})
        raise
    except BaseException as e:
        session.mirror = None
        team.post("lead", {"end": {"stop": f"the leading rank's attempt failed: {e!r}", "reason": "error"}})
        raise
    session.mirror = None
    team.post("lead", {"end": {"rows": rows, "background": background}})
    return rows, background


def _follow(session: LiveSession, team: Team, leader: int, healthy: StepInput, before: tuple[dict, dict]) -> Any:
    """Another rank leads: run this rank's healthy batch alongside each of its runs, until it says what it found."""
    while True:
        msg = team.read("lead", leader)
        end = msg.get("end")
        if end is not None:
            if "stop" in end:
                raise Refused(end.get("reason", "evidence"), f"rank {leader}: {end['stop']}")
            return end
        session.run([healthy], before)
