"""The shrink scheduler: runs the passes to a joint fixpoint within a replay budget."""

from __future__ import annotations

import contextlib
import copy
import json
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprokit import pytree
from reprokit.bundle import (
    MANIFEST,
    REPLICATED,
    Bundle,
    BundleWriter,
    StepRecord,
    claimed_output,
    jsonable,
    open_bundle,
    part_sizes,
    sha256_file,
    write_bundle,
)
from reprokit.code import git_info, snapshot_files
from reprokit.errors import ConfigError, DidNotReproduce, ReprokitError
from reprokit.isolation import IsolatedRunner
from reprokit.origin import Origin, same_origin, watch_step
from reprokit.replayer import RunOutcome, Session, StepInput, alone_hint, default_device
from reprokit.shrink import micro
from reprokit.shrink.batch import concat_rows, dataset_indices, select_rows, select_seq, seq_len, token_positions
from reprokit.shrink.case import Case, Snapshot, failed, failure_of, rows_and_seq, what_happened
from reprokit.shrink.culprit import STATE, check_state
from reprokit.shrink.passes import PASSES
from reprokit.shrink.registry import DATA_PASSES
from reprokit.signature import DEATHS, NONFINITE, Failure, FailureKind, message_template

Progress = Callable[[str, int, str], None]


CONFIRM_TIMES = 2
"""Extra replays of the shrunk case before it is written: it must fail the same way on each."""
FLAKY_HINT = ("Shrinking needs a failure that recurs on every replay: run `reprokit replay BUNDLE --times 5`; a flaky "
              "verdict usually means a random generator outside state.extra or state kept outside train_step.")


class FlakyFailure(DidNotReproduce):
    """The failure reproduced on one replay and not on another: shrinking would trust lucky replays."""


class BudgetExhausted(Exception):
    """Internal: the replay budget ran out mid-pass."""


@dataclass
class PassStats:
    runs: int = 0
    accepted: int = 0
    replays: int = 0
    seconds: float = 0.0


@dataclass
class ShrinkResult:
    """What ``shrink`` did. ``to_json()`` is what ``reprokit shrink --json`` prints."""

    output: Path
    replays: int
    before: dict[str, Any]
    after: dict[str, Any]
    kept_rows: list[int] | None
    dataset_indices: list[Any] | None
    seq_window: list[int] | None
    passes: dict[str, PassStats]
    seconds: float
    budget_exhausted: bool
    failure: Failure
    different_failures: int = 0
    origin: Origin | None = None
    origin_checks: int = 0
    origin_changed: int = 0
    confirm_runs: int = 0
    code: dict[str, Any] | None = None
    """With ``--code DIR``: DIR and its git commit, whose files the result carries (None: the source's snapshot)."""
    disk: dict[str, int] = field(default_factory=dict)
    """Bytes on disk of the source and the result, all files and the state alone (``bytes_before``,
    ``bytes_after``, ``state_bytes_before``, ``state_bytes_after``; the manifests' sizes)."""
    rows_ambiguous: str | None = None
    """Why rows and sequence were not cut: the batch's row dimension could not be told (see
    :func:`reprokit.shrink.micro.ambiguous`)."""
    state_check: dict[str, Any] | None = None
    """Whether the failing step fails from its start state on other steps' batches (see
    :mod:`reprokit.shrink.culprit`); with the verdict ``state``, no row or dataset index is named."""
    isolation: dict[str, Any] | None = None
    """When candidates ran in child processes (``--isolate``, or a crash / device-error bundle): the children
    started and died, and their start-up time (see :meth:`reprokit.isolation.IsolatedRunner.summary`)."""

    def to_json(self) -> dict[str, Any]:
        return jsonable({
            "output": str(self.output),
            "replays": self.replays,
            **{f"{k}_before": v for k, v in self.before.items()},
            **{f"{k}_after": v for k, v in self.after.items()},
            "kept_rows": self.kept_rows,
            "dataset_indices": self.dataset_indices,
            "state_check": self.state_check,
            "isolation": self.isolation,
            "rows_ambiguous": self.rows_ambiguous,
            "seq_window": self.seq_window,
            "budget_exhausted": self.budget_exhausted,
            "different_failures": self.different_failures,
            "origin": self.origin.to_json() if self.origin else None,
            "origin_checks": self.origin_checks,
            "origin_changed": self.origin_changed,
            "confirm_runs": self.confirm_runs,
            **self.disk,
            "code": self.code,
            "seconds": round(self.seconds, 3),
            "failure": self.failure.summary(),
            "passes": {k: vars(v) | {"seconds": round(v.seconds, 3)} for k, v in self.passes.items()},
        })


def dims(case: Case, pad_id: int) -> dict[str, Any]:
    b = case.last.batch
    n, s = case.rows_and_seq()
    return {"steps": len(case.inputs), "rows": n, "seq": s, "tokens": len(token_positions(b, pad_id))}


@dataclass
class Shrinker:
    """Owns the cache, the budget, the per-pass stats and the best case so far."""

    session: Session
    budget: int = 300
    pad_id: int = 0
    isolate: bool = False
    timeout: float = 60.0
    runner: IsolatedRunner | None = None
    """The child processes that judge candidates when ``isolate`` (made at the first; the caller closes it)."""
    progress: Progress | None = None
    replays: int = 0
    steps_run: int = 0
    different_failures: int = 0
    """Candidates rejected because they failed, but not the same way."""
    origin: Origin | None = None
    """Where the original's first non-finite value appeared; candidates must keep it (see :meth:`keeps_origin`)."""
    origin_checks: int = 0
    """Origin runs: one per candidate that failed with the same signature (not counted in ``replays``); for a loss
    spike, one run of the rows the candidate dropped."""
    origin_changed: int = 0
    """Candidates with the same signature rejected because their first non-finite value moved (for a loss spike:
    because the rows they dropped spike on their own)."""
    spike: bool = False
    """The failure is a loss spike: candidates must not spike without their rows too (see :meth:`spikes_without`)."""
    spike_rise: tuple[float, float] | None = None
    """For a loss spike: the failing step's loss on replay and the median it was judged against (the state check
    asks how much of the rise other batches make from the same state, see :mod:`reprokit.shrink.culprit`)."""
    reference: tuple[Any, int] | None = None
    """The original failing batch and its row count: control rows for origin checks come from it."""
    message: str | None = None
    """For an exception: the original's :func:`~reprokit.signature.message_template` on this machine. A candidate
    raising the same type in the same frame with another message (a check that the cut batch is too small) is
    another failure."""
    confirm_runs: int = 0
    """Replays of the original and of the result that check the failure recurs every time (see :meth:`confirm`)."""
    best: Case | None = None
    _cache: dict[str, tuple[bool, RunOutcome | dict]] = field(default_factory=dict)
    _snapshots: dict[tuple, tuple[Snapshot, int]] = field(default_factory=dict)
    _next_snap_id: int = 1
    _current_pass: str = "check"

    def test(self, case: Case) -> bool:
        """Does ``case`` fail the same way? Cached; each new candidate costs one replay."""
        key = case.key()
        if key not in self._cache:
            if self.replays >= self.budget:
                raise BudgetExhausted
            self.replays += 1
            interesting, out = self._judge(case)
            self._cache[key] = interesting, out
            if interesting and (self.best is None or case.sort_key(self.pad_id) < self.best.sort_key(self.pad_id)):
                self.best = case
            if self.progress:
                size = dims(self.best, self.pad_id) if self.best else {}
                self.progress(self._current_pass, self.replays, ", ".join(f"{k} {v}" for k, v in size.items()))
        return self._cache[key][0]

    def _judge(self, case: Case) -> tuple[bool, RunOutcome | dict]:
        """Replay ``case`` once (uncached, outside the budget): does it fail the same way, and what happened."""
        interesting, out = self._isolated(case) if self.isolate else self._in_process(case)
        if interesting and self.message is not None and message_template(failure_of(out).message) != self.message:
            interesting = False
            self.different_failures += 1
        elif interesting and self.origin is not None:
            interesting = self.keeps_origin(case)
            self.origin_changed += not interesting
        elif interesting and self.spike:
            interesting = not self.spikes_without(case)
            self.origin_changed += not interesting
        elif not interesting and failed(out):
            self.different_failures += 1
        return interesting, out

    def arm(self, original: Case, n: int | None) -> None:
        """Set what judges a candidate beside its signature, from ``original`` (the failing case, already found to
        fail the same way; ``n``: its failing batch's row count): the origin of a non-finite failure (checked once
        here, then for every candidate that fails with the same signature), the rise of a loss spike, the message
        template of an exception."""
        kind = self.session.recorded.kind
        first = original.last.batch
        if kind in NONFINITE:
            self.origin, self.reference = self.find_origin(original), (first, n or 0)
        elif kind == FailureKind.LOSS_SPIKE:
            self.spike, self.reference = True, (first, n or 0)
            detail = failure_of(self.outcome(original)).detail
            if isinstance(detail.get("loss"), float) and isinstance(detail.get("median"), float):
                self.spike_rise = detail["loss"], detail["median"]
        elif kind == FailureKind.EXCEPTION:
            self.message = message_template(failure_of(self.outcome(original)).message)

    def confirm(self, case: Case, times: int) -> str | None:
        """Replay ``case``, already found interesting, ``times`` more times; None when it failed the same way each
        time, else what the replay that did not did.

        Each candidate is judged on one replay; a failure that does not recur on every replay (a random generator
        outside ``state.extra``, a counter kept outside the state, a data race) would let a lucky replay accept a
        candidate that does not hold the bug. These runs are ``confirm_runs``, not ``replays``.
        """
        for _ in range(times):
            self.confirm_runs += 1
            interesting, out = self._judge(case)
            if not interesting:
                return what_happened(out)
        return None

    def find_origin(self, case: Case) -> Origin | None:
        """Run ``case``'s failing step once more, watched; the original's origin (rows = original positions)."""
        snap = self.snapshot_at(case, len(case.inputs) - 1)
        if snap is None:
            return None
        self.origin_checks += 1
        # Micro-batches run one forward each: rows of the origin's op are a micro-batch's, not the update's.
        rows = None if micro.layout(case.last.batch) else case.n_rows
        _, origin = watch_step(self.session, case.last, snap[0], rows)
        self.steps_run += 1
        return origin

    def spikes_without(self, case: Case) -> bool:
        """For a loss spike: do the original rows ``case`` dropped, cut like it, spike at its step on their own?

        A spike compares a loss to the median of earlier whole-batch losses, and one ordinary but hard row alone is
        far above it: a candidate of that row spikes too, with the same signature, while the rows that made the
        recorded spike were dropped. The spike is theirs when the dropped rows alone still make it.
        """
        assert self.reference is not None
        original, n0 = self.reference
        if case.rows is None or len(case.rows) >= n0 or micro.layout(original) is not None:
            return False
        kept = set(case.rows)
        others = [r for r in range(n0) if r not in kept]
        rest = select_rows(original, n0, others)
        s0 = seq_len(original, n0)
        if case.seq is not None and s0 is not None and case.seq != (0, s0):
            rest = select_seq(rest, len(others), s0, *case.seq)
        last = StepInput(case.last.step, rest, case.last.rng, case.last.rng_tensors)
        self.origin_checks += 1
        out = self.session.run((*case.inputs[:-1], last), case.snapshot)
        self.steps_run += len(out.losses)
        return out.same

    def keeps_origin(self, case: Case) -> bool:
        """Does ``case``, which fails with the same signature, still fail for the same reason?

        Its failing step is run watched, with one *control* row appended when every row
        it kept was non-finite at the origin: an original row that was finite there, cut
        to the same sequence window. The first non-finite value must appear at the same
        place (op, module or step-function line, phase) and only in rows that were
        non-finite there originally. A cut that makes any row fail (a 1-position
        sequence with no target: 0/0 for every document) also fails the control row,
        so it is rejected even once the culprit is the only row left.
        """
        assert self.origin is not None
        snap = self.snapshot_at(case, len(case.inputs) - 1)
        if snap is None:
            return False
        batch, n = case.last.batch, case.n_rows
        row_ids = list(case.rows) if case.rows is not None else None
        if micro.layout(batch) is not None:
            n = row_ids = None  # the origin's rows were not attributed (see find_origin): its place is compared
        control = self._control(case, row_ids)
        if control is not None and n is not None and row_ids is not None:
            merged = concat_rows(batch, n, control[1])
            if merged is not None:
                batch, n, row_ids = merged, n + 1, [*row_ids, control[0]]
        self.origin_checks += 1
        inp = StepInput(case.last.step, batch, case.last.rng, case.last.rng_tensors)
        _, got = watch_step(self.session, inp, snap[0], n)
        self.steps_run += 1
        return same_origin(self.origin, got, row_ids)

    def _control(self, case: Case, row_ids: list[int] | None) -> tuple[int, Any] | None:
        """The first original row that was finite at the origin, cut like ``case``; None when not needed."""
        assert self.origin is not None
        bad = self.origin.rows
        if bad is None or row_ids is None or self.reference is None or any(r not in bad for r in row_ids):
            return None
        original, n0 = self.reference
        r = next((r for r in range(n0) if r not in bad), None)
        if r is None:
            return None
        row = select_rows(original, n0, [r])
        s0 = seq_len(original, n0)
        if case.seq is not None and s0 is not None and case.seq != (0, s0):
            row = select_seq(row, 1, s0, *case.seq)
        return r, row

    def outcome(self, case: Case) -> RunOutcome | dict:
        return self._cache[case.key()][1]

    def _in_process(self, case: Case) -> tuple[bool, RunOutcome]:
        out = self.session.run(case.inputs, case.snapshot)
        self.steps_run += len(out.losses)
        return out.same, out

    def _isolated(self, case: Case) -> tuple[bool, RunOutcome | dict]:
        """Replay ``case`` in a child process (:mod:`reprokit.isolation`): a death (a segfault, an abort) is the
        candidate's outcome, judged like any failure, and a hang past ``timeout`` costs the candidate (no verdict:
        ``{}``), never the shrink. The child is reused until a candidate kills it."""
        if self.runner is None:
            self.runner = IsolatedRunner()
        with tempfile.TemporaryDirectory(prefix="reprokit-candidate-") as tmp:
            path = write_case(self.session, case, Path(tmp), "candidate", self.session.recorded.to_json(), None, {})
            attempt = self.runner.attempt(path, recorded=self.session.recorded, device=self.session.device.type,
                                          code=self.session.user_code, timeout=self.timeout)
        self.steps_run += len(case.inputs)
        if attempt.outcome is None:
            return False, {}
        return attempt.outcome.same, attempt.outcome

    def snapshot_at(self, case: Case, k: int) -> tuple[Snapshot, int] | None:
        """State just before ``case.inputs[k]``: replays the first k steps once, then cached."""
        if k == 0:
            return case.snapshot, case.snap_id
        key = (case.snap_id, tuple(inp.digest for inp in case.inputs[:k]))
        if key not in self._snapshots:
            snap = self.session.advance(case.inputs[:k], case.snapshot)
            self.steps_run += k
            if snap is None:
                return None
            self._snapshots[key] = (snap, self._next_snap_id)
            self._next_snap_id += 1
        return self._snapshots[key]

    def run(self, case: Case, passes: Sequence[str]) -> tuple[Case, dict[str, PassStats], bool]:
        stats = {name: PassStats() for name in passes}
        order = list(passes)
        exhausted = False
        while not exhausted:
            progressed = []
            for name in order:
                self._current_pass = name
                before, replays0, t0 = self.best, self.replays, time.perf_counter()
                stats[name].runs += 1
                try:
                    # The pass's own answer is not needed: every interesting candidate already went through
                    # test(), which keeps the smallest as self.best (see the contract in passes.py).
                    PASSES[name](self, self.best)  # type: ignore[arg-type]
                except BudgetExhausted:
                    exhausted = True
                stats[name].replays += self.replays - replays0
                stats[name].seconds += time.perf_counter() - t0
                if self.best is not before:
                    stats[name].accepted += 1
                    progressed.append(name)
                if exhausted:
                    break
            if not progressed:
                break
            # Passes that just made progress go first in the next round.
            order = progressed + [n for n in order if n not in progressed]
        assert self.best is not None
        return self.best, stats, exhausted


def write_case(session: Session, case: Case, out_dir: Path, name: str, failure: dict[str, Any],
               outcome: RunOutcome | None, provenance: dict[str, Any], exact: bool = False) -> Path:
    """Write ``case`` as an ordinary bundle (manifest, checksums) next to its source's code and env."""
    src: Bundle = session.bundle
    run = copy.deepcopy(src.run)
    steps = [inp.step for inp in case.inputs]
    losses = outcome.losses if outcome else {}
    run["window"] = {"start": steps[0], "end": steps[-1], "steps": steps}
    run["history"] = [h for h in run["history"] if h["step"] < steps[0]] + [
        {"step": k, "loss": losses.get(k), "grad_norm": None} for k in steps]
    if provenance:
        run["provenance"] = provenance
    records = []
    for inp in case.inputs:
        tree, tensors = pytree.encode(inp.batch, "batch")
        records.append(StepRecord(inp.step, tree, {**tensors, **inp.rng_tensors}, inp.rng, losses.get(inp.step)))
    snap_tree, snap_tensors = case.snapshot
    snap_tree = {**snap_tree, "step": steps[0]}
    return write_bundle(BundleWriter(out_dir, name, exact=exact), failure=failure, run=run, env=src.env,
                        state=(snap_tree, snap_tensors), steps=records, code=code_replayed(session))


def code_replayed(session: Session) -> list[tuple[str, Path]]:
    """The code the session runs, as ``(rel, file)`` for a bundle's ``code/``: with ``--code DIR``, the files of DIR
    it imported (what the shrink verified the failure against, not the source bundle's snapshot, which may differ);
    else the snapshot's verified private copy, whole. Call inside the session (its imports are still loaded)."""
    if session.code_dir is None:
        return []
    root = session.code_dir.resolve()
    files = snapshot_files(root) if session.user_code is not None else \
        sorted(p for p in root.rglob("*") if p.is_file() and p.suffix == ".py" and "__pycache__" not in p.parts)
    return [(p.relative_to(root.resolve()).as_posix(), p) for p in files]


def shrink(bundle: str | Path | Bundle, output: str | Path, *, budget: int = 300,
           passes: Sequence[str] = tuple(PASSES), pad_id: int = 0, isolate: bool = False, timeout: float = 60.0,
           device: str | None = None, code: str | Path | None = None, progress: Progress | None = None) -> ShrinkResult:
    """Minimise a bundle: fewest steps, rows, sequence positions and meaningful tokens, same failure
    (and for a non-finite one, the same origin: see :mod:`reprokit.origin`).

    Args:
        bundle: the failing bundle.
        output: directory to write the shrunk bundle to (must not exist yet).
        budget: most candidate replays to spend. For a non-finite failure, each candidate that
            fails with the same signature is also run once more (its failing step only) to
            check the origin; those runs are ``origin_checks``, not replays.
        passes: which passes to run, from ``steps``, ``rows``, ``sequence``, ``tokens``.
        pad_id: the neutral value for integer tensors in the ``tokens`` pass.
        isolate: replay each candidate in a child process (segfaults, hangs), ``timeout`` seconds each; always so
            for a bundle whose failure is a ``crash`` or ``device_error``.

    Raises:
        DidNotReproduce: when the bundle does not fail the same way to begin with.

    Example:
        >>> r = shrink("repros/bundle-...", "small")                       # doctest: +SKIP
        >>> r.after["rows"], r.kept_rows                                    # doctest: +SKIP
        (1, [7])
    """
    t0 = time.perf_counter()
    unknown = [p for p in passes if p not in PASSES]
    if unknown or not passes:
        raise ConfigError.option("passes", f"unknown shrink pass(es) {', '.join(unknown) or '(none given)'} in "
                                           f"{{opt}}; choose from {', '.join(PASSES)}")
    if budget < 1:
        raise ConfigError.option("budget", f"{{opt}} must be >= 1, got {budget}")
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise ReprokitError(f"{output} already exists and is not empty; pick another -o or remove it")
    src = bundle if isinstance(bundle, Bundle) else open_bundle(bundle)
    # A step that can kill the process is judged in child processes, whatever --isolate says; a device error
    # replayed on the CPU is a clean exception there (its CPU face), and needs none.
    on_cpu = (device or default_device(src)) == "cpu"
    isolate = isolate or (src.failure.kind in DEATHS and not (src.failure.kind == FailureKind.DEVICE_ERROR and on_cpu))
    with claimed_output(output), Session(src, device=device, code=code) as session, \
            (IsolatedRunner() if isolate else contextlib.nullcontext()) as runner:
        inputs = tuple(session.inputs())
        first = inputs[-1].batch
        lay = micro.layout(first)
        n, s = rows_and_seq(first)
        rows0 = micro.units(first, lay) if lay is not None else tuple(range(n)) if n else None
        rows0 = None if micro.ambiguous(first) else rows0
        original = Case(inputs, session.snapshot, 0, rows0, (0, s) if s else None)
        sh = Shrinker(session, budget=budget, pad_id=pad_id, isolate=isolate, timeout=timeout, progress=progress,
                      runner=runner)
        if not sh.test(original):
            out = sh.outcome(original)
            got = out.failure.describe() if isinstance(out, RunOutcome) and out.failure else "no failure"
            raise DidNotReproduce(
                f"{src.path} does not reproduce ({got} on replay; recorded: {src.failure.describe()}), so there is "
                f"nothing to shrink. {alone_hint(src)}"
            )
        sh.arm(original, n)
        missed = sh.confirm(original, 1)
        if missed:
            raise FlakyFailure(f"{src.path} failed the same way on one replay but not on the next ({missed}), so "
                               f"shrinking could not tell a smaller case that holds the bug from a lucky replay. "
                               f"{FLAKY_HINT}")
        before = dims(original, pad_id)
        # Before any pass looks for rows to blame: does the failing step fail on other steps' data too?
        checked = check_state(sh, original)
        if checked.verdict == STATE:
            passes = [p for p in passes if p not in DATA_PASSES]
        ambiguity = micro.ambiguous(first)
        if ambiguity:  # cutting along a guessed dimension would report rows that are not rows
            passes = [p for p in passes if p not in ("micro", "rows", "sequence")]
        best, stats, exhausted = sh.run(original, passes)
        missed = sh.confirm(best, CONFIRM_TIMES) if best is not original else None
        if missed:
            size = ", ".join(f"{k} {v}" for k, v in dims(best, pad_id).items())
            raise FlakyFailure(f"the smallest case shrinking found in {src.path} ({size}) did not fail the same way on "
                               f"each of {CONFIRM_TIMES} more replays ({missed}); nothing was written. {FLAKY_HINT}")
        out = sh.outcome(best)
        failure = _recorded_kind(src.failure, failure_of(out))
        blamed = checked.verdict != STATE
        kept = list(best.rows) if blamed and best.rows is not None and n and len(best.rows) < n else None
        indices = None if not blamed else micro.indices(first, lay, best.rows) \
            if lay is not None and best.rows is not None else dataset_indices(first, best.rows)
        window = list(best.seq) if best.seq else None
        provenance: dict[str, Any] = {
            "source_bundle": str(src.path),
            "source_manifest_sha256": sha256_file(src.path / MANIFEST),
            "passes": {k: vars(v) for k, v in stats.items()},
            "replays": sh.replays,
            "different_failures": sh.different_failures,
            "origin": sh.origin.to_json() if sh.origin else None,
            "origin_checks": sh.origin_checks,
            "origin_changed": sh.origin_changed,
            "confirm_runs": sh.confirm_runs,
            "kept_rows": list(best.rows) if blamed and best.rows is not None else None,
            "state_check": checked.to_json(),
            "rows_ambiguous": ambiguity,
            "dataset_indices": indices,
            "seq_window": window,
            "before": before,
        }
        if session.user_code is not None:
            # The result carries the --code files it was verified against: say where they came from.
            git = git_info(session.user_code) or {}
            provenance["code"] = {"shrunk_against": str(session.user_code), "git_commit": git.get("commit"),
                                  "git_dirty": git.get("dirty")}
        written = write_case(session, best, output.parent, output.name, failure.to_json(),
                             out if isinstance(out, RunOutcome) else None, provenance, exact=True)
        disk = {**_disk_bytes(src.manifest, "before"), **_disk_bytes(json.loads((written / MANIFEST).read_text()),
                                                                         "after")}
        return ShrinkResult(written, sh.replays, before, dims(best, pad_id), kept, indices, window, stats,
                            time.perf_counter() - t0, exhausted, failure, sh.different_failures, sh.origin,
                            sh.origin_checks, sh.origin_changed, sh.confirm_runs, provenance.get("code"), disk,
                            state_check=checked.to_json(), rows_ambiguous=ambiguity,
                            isolation=runner.summary() if runner is not None else None)


def _recorded_kind(recorded: Failure, got: Failure) -> Failure:
    """The failure the shrunk bundle records: ``got``, or for a device error shrunk on the CPU, the recorded device
    error at ``got``'s step (``detail.cpu_face`` says what the CPU raised), so that the result replays as one: its
    GPU face on a GPU, its CPU face on the CPU."""
    if recorded.kind != FailureKind.DEVICE_ERROR or got.kind == FailureKind.DEVICE_ERROR:
        return got
    return Failure(recorded.kind, got.step, recorded.exc_type, recorded.message, recorded.frame, recorded.traceback,
                   {**recorded.detail, "cpu_face": got.summary()}, recorded.frame_qualname)


def _disk_bytes(manifest: dict[str, Any], when: str) -> dict[str, Any]:
    """``bytes_<when>`` and ``state_bytes_<when>`` of the files a bundle's manifest lists (and
    ``state_referenced_<when>`` for a state that is another rank's files: not counted here)."""
    parts = part_sizes(manifest["files"])
    out: dict[str, Any] = {f"bytes_{when}": sum(parts.values()), f"state_bytes_{when}": parts["state"]}
    if REPLICATED in manifest["files"]:
        out[f"state_referenced_{when}"] = True
    return out