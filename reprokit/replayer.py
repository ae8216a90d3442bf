"""Replay a bundle: rebuild the state, re-run the window, compare the failure.

:class:`Session` loads a bundle once and can then run the window (or a variant
of it: fewer steps, edited batches) many times, restoring the snapshot in
memory before each run. :func:`replay` is the one-call form behind
``reprokit replay``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import platform
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reprokit import device_error, pytree, triage
from reprokit.bundle import FAILURE, REPLICATED, Bundle, jsonable, open_bundle, schema
from reprokit.code import check_refs, imported, materialize, resolve
from reprokit.detect import DetectSettings, Monitor
from reprokit.distributed import world_size
from reprokit.env import apply_determinism_flags
from reprokit.errors import BundleError, CodeLoadError, ConfigError, ReprokitError, StateMismatchError
from reprokit.isolation import IsolatedRunner, isolation_lines, isolation_summary
from reprokit.outcome import RunOutcome
from reprokit.signature import DEATHS, Failure, FailureKind, summary_line
from reprokit.state import (
    BUFFERS,
    MODEL,
    OPTIMIZER,
    SHARDS,
    TrainState,
    capture_rng,
    capture_state,
    put_buffers,
    restore_rng,
    restore_state,
    volatile_buffers,
)


@dataclass
class StepInput:
    """One step to run: its number, batch and the RNG state at its start."""

    step: int
    batch: Any
    rng: dict[str, Any]
    rng_tensors: dict[str, torch.Tensor]

    @cached_property
    def digest(self) -> str:
        """Content hash of the batch (and step number): equal inputs, equal digests."""
        h = hashlib.sha1(str(self.step).encode())
        for path, leaf in pytree.leaves(self.batch):
            h.update(path.encode())
            if isinstance(leaf, torch.Tensor):
                h.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
                h.update(leaf.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                         if leaf.numel() else b"")
            else:
                h.update(repr(leaf).encode())
        return h.hexdigest()


# What ``reprokit replay`` exits with for each verdict. 1 / 0 / 125 are what ``git bisect run``
# reads as bad / good / skip: a different failure says nothing about the recorded bug.
VERDICT_EXIT_CODES = {"deterministic": 1, "flaky": 1, "different_failure": 125, "not_reproduced": 0}

VERDICT_HEADLINES = {"deterministic": "REPRODUCED", "flaky": "REPRODUCED (flaky)",
                     "different_failure": "DIFFERENT FAILURE", "not_reproduced": "NOT REPRODUCED"}

def verdict_of(failed: int, different: int, runs: int) -> str:
    """The verdict of ``runs`` replays of which ``failed`` failed the recorded way and ``different`` otherwise."""
    if failed:
        return "deterministic" if failed == runs else "flaky"
    return "different_failure" if different else "not_reproduced"


def verdict_phrase(verdict: str, runs: int | None, times_flag: str | None = "--times N") -> str:
    """The verdict in words for people: ``deterministic`` is said only when more than one run showed it (the JSON
    verdict of a single reproducing run stays ``deterministic``; ``determinism_checked`` tells them apart).
    ``times_flag``: the option that asks for more runs where the phrase is read (None: the phrase alone)."""
    if verdict == "deterministic" and (runs or 0) <= 1:
        return "reproduced once" + (f"; {times_flag} tells deterministic from flaky" if times_flag else "")
    return verdict

TRANSIENT_NOTE = (
    "transient: the recorded code, state and batches replayed on the same kind of device, bit-exact up to the "
    "failing step, and the failure did not recur. Nothing recorded explains it (a hardware fault, a data race, "
    "or an input outside the recording): this is not a fix. Check the device and rerun the job.")

NOT_BIT_EXACT_HINT = (
    "replayed on the device it was recorded on, losses should be bit-exact; common causes: a random generator "
    "outside state.extra (a torch.Generator, random.Random or numpy Generator your step draws from), training "
    "state changed outside train_step (LR, counters, weights edited in the loop), a non-persistent buffer or a plain "
    "attribute of a module that your step changes (in no state_dict, so in no snapshot: replay starts it as build() "
    "makes it; keep such state in state.extra or a persistent buffer), or a nondeterministic kernel "
    "(check with `reprokit bisect precision BUNDLE --variants deterministic`)")


@dataclass
class ReplayReport:
    """N replays of a bundle and what they add up to.

    Verdicts: ``deterministic`` (every run failed with the recorded signature at the
    recorded step; from one run, that one run did: ``determinism_checked`` is then false),
    ``flaky`` (some did; the others passed or failed differently:
    ``per_run`` says which), ``different_failure`` (none did, and at least one run
    failed with another signature or at another step), ``not_reproduced`` (every
    run passed). ``exit_code`` is what ``reprokit replay`` exits with.
    """

    bundle: Path
    recorded: Failure
    runs: list[RunOutcome]
    fidelity: dict[str, Any]
    device: str
    code: str
    distributed: dict[str, Any] | None = None
    """The rank, world size and incident the bundle was recorded in, when it came from a multi-rank run."""
    isolation: dict[str, Any] | None = None
    """Set when each run ran in a child process (see :func:`replay_isolated`): the children
    started and what that cost, the peak host memory of a run beside the recorded machine's, and a note on a crash
    that replayed clean."""
    triage: dict[str, Any] | None = None
    """For a ``device_error`` bundle (see :mod:`reprokit.triage`): the CPU replay, the culprit it named, the GPU
    replay, and what the verdict rests on (``reproduced_as``: ``device_error`` or ``cpu_face``)."""

    @property
    def failed_runs(self) -> int:
        """Runs that failed the same way at the same step."""
        return sum(r.same for r in self.runs)

    @property
    def different_runs(self) -> int:
        """Runs that failed, but with another signature or at another step."""
        return sum(r.failure is not None and not r.same for r in self.runs)

    @property
    def reproduced(self) -> bool:
        return self.failed_runs > 0

    @property
    def verdict(self) -> str:
        return verdict_of(self.failed_runs, self.different_runs, len(self.runs))

    @property
    def exit_code(self) -> int:
        return VERDICT_EXIT_CODES[self.verdict]

    @property
    def transient(self) -> bool:
        """Not reproduced, although the recorded code ran on the recorded kind of device from the recorded state
        and batches, and every loss before the failing step was bit-exact: nothing recorded explains the failure
        (a transient fault, a data race, or an input outside the recording). Not a fix."""
        f = self.fidelity
        if self.verdict != "not_reproduced" or not (f.get("same_device") and f.get("same_code")) or (
                self.isolation and self.isolation.get("note")):  # a kill from outside: its note says what it was
            return False
        first = f.get("first_diverging_step")
        return first is None or first >= self.recorded.step

    def to_json(self) -> dict[str, Any]:
        first = next((r.failure for r in self.runs if r.same), None) or next(
            (r.failure for r in self.runs if r.failure), None)
        return jsonable({
            "bundle": str(self.bundle),
            "reproduced": self.reproduced,
            "runs": len(self.runs),
            "failed_runs": self.failed_runs,
            "different_runs": self.different_runs,
            "verdict": self.verdict,
            # One run cannot tell deterministic from flaky: the verdict key keeps its value, this says it was unchecked.
            "determinism_checked": len(self.runs) > 1,
            "exit_code": self.exit_code,
            "transient": self.transient,
            "failure": _failure_summary(first),
            "recorded_failure": _failure_summary(self.recorded),
            "fidelity": self.fidelity,
            "device": self.device,
            "code": self.code,
            "distributed": self.distributed,
            "isolation": self.isolation,
            "triage": self.triage,
            "per_run": [r.to_json() for r in self.runs],
        })


def _failure_summary(f: Failure | None) -> dict[str, Any] | None:
    return None if f is None else f.summary()


def default_device(bundle: Bundle) -> str:
    recorded = str(bundle.run.get("device", "cpu"))
    return "cuda" if recorded.startswith("cuda") and torch.cuda.is_available() else "cpu"


def code_label(bundle: Bundle, user_code: Path | None) -> str:
    """What a report names as the code replayed: the ``--code`` folder, or the bundle's code/ (a verified copy)."""
    return str(user_code or bundle.code_dir or "reprokit's own modules (the bundle holds no project code)")


class Session:
    """A bundle loaded once, ready to be run many times.

    Use as a context manager: imports of the user's code are isolated to it.

    Example:
        >>> with Session(open_bundle(path)) as s:                       # doctest: +SKIP
        ...     outcome = s.run(s.inputs())
    """

    def __init__(self, bundle: Bundle, *, device: str | None = None, code: str | Path | None = None,
                 preload: bool = False):
        """``preload=True``: copy the state to the GPU while it is read, for the first :meth:`restore` (see
        :class:`_Preload`; :func:`replay` does). That restore then uses the copies made at load time, so an edit
        made to ``self.snapshot`` before it is not seen; later restores read ``self.snapshot``."""
        self.bundle = bundle
        self._preload_on = preload
        self._preload: _Preload | None = None
        self._steps_ahead: Future[dict[int, Any]] | None = None
        self.device = torch.device(device or default_device(bundle))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError.option("device", "{opt} cuda was asked for, but torch sees no CUDA device here; use {opt} cpu")
        self.user_code: Path | None = Path(code).resolve() if code else None
        """The ``--code`` folder (None: the bundle's own snapshot is replayed)."""
        if code and not (self.user_code and self.user_code.is_dir()):
            raise CodeLoadError(f"--code {code}: no such directory")
        self._stack = ExitStack()
        self.code_dir = self.user_code
        """Where build/step are imported from: ``--code``, or a private copy of the snapshot's verified bytes."""
        self._code_copy: weakref.finalize | None = None
        if self.user_code is None and bundle.code_dir is not None:
            # Never the bundle folder itself: a file swapped there after verification would run unchecked.
            self.code_dir, remove = materialize(bundle.code_files())
            # Removed by drop_code_copy(), else once the session is gone (extract copies it after the session
            # closed), at the latest at exit.
            self._code_copy = weakref.finalize(self, remove)
        self.code_label = code_label(bundle, self.user_code)
        """What the report names as the code replayed: the --code folder, or the bundle's code/ (a verified copy)."""
        # run.json comes from whoever sent the bundle: its refs may only name the code replay runs.
        check_refs(bundle.run.get("refs"), snapshot=self.code_dir if self.user_code is None else bundle.code_dir,
                   code=self.user_code, source=bundle.path / "run.json")
        self.recorded = bundle.failure
        self.state: TrainState | None = None
        self.on_step: Callable[[str, int, float | None], None] | None = None
        """Called by :meth:`run` as each step starts (``("started", step, None)``) and ends (``("finished", step,
        loss)``): a child process of :mod:`reprokit.isolation` tells its parent, so a step that kills it is known."""
        self.after_restore: list[Callable[[TrainState], None]] = []
        """Run at the end of every :meth:`restore`, in order: a change to the state that must outlive what restore
        puts back (``bisect precision``'s fp32 upcast: restore casts parameters back to their recorded dtype)."""

    def __enter__(self) -> Session:
        try:
            self._enter()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _enter(self) -> None:
        run = self.bundle.run
        # verify refuses these already; a Bundle whose docs were changed in memory (a tool's) must not pass either.
        lies = schema.uncheckable(run, self.bundle.docs[FAILURE])
        if lies:
            raise BundleError(f"{self.bundle.path}: {'; '.join(f'{rel}: {why}' for rel, why in lies)}",
                              [{"file": rel, "problem": why} for rel, why in lies])
        refs = run["refs"]
        # An integration's build imports only the classes refs.objects lists (vetted and confirmed already).
        self._stack.enter_context(imported(self.code_dir, refs.get("objects") or ()))
        build = resolve(refs["build"], self.code_dir, "refs.build")
        self.step_fn = resolve(refs["step"], self.code_dir, "refs.step")
        predicates = [resolve(r, self.code_dir, f"refs.predicates[{i}]")
                      for i, r in enumerate(refs.get("predicates", [])) if r is not None]
        flags = apply_determinism_flags({**run.get("determinism", {}), **run.get("precision", {})})
        self._stack.callback(apply_determinism_flags, flags)
        config = pytree.decode(run["config"], {})
        _refuse_shards_alone(self.bundle)
        try:
            state = build(config)
        except ReprokitError:
            raise  # reprokit's own build (an integration's) refusing: its message says what to do
        except Exception as e:
            raise CodeLoadError(f"build(config) failed: {type(e).__name__}: {e}") from e
        state = as_train_state(state)
        state.model.to(self.device)
        self.state = state
        # Non-persistent buffers are in no snapshot the recorder took: every restore of the bundle's snapshot puts
        # back what build() made, so that no replay starts from what the last one left (kept in host memory).
        self._built_buffers = {k: v.detach().to("cpu", copy=True) for k, v in volatile_buffers(state.model).items()}
        self._preload = _Preload.make(state, self.bundle, self.device) if self._preload_on else None
        self._stack.callback(self._drop_preload)
        self._read_steps_ahead()
        tree, tensors = self.bundle.state(on_part=self._preload)
        self.snapshot = (tree, tensors)
        # A bundle from before the loss was read out of a dict / number lacks the key: judge it as it was recorded.
        detect = {"loss_from_mapping": False, **run["recorder"]["detect"], **_recorded_check(self.recorded)}
        if self.recorded.kind == FailureKind.PREDICATE and not predicates:
            raise BundleError(f"{self.bundle.path}: the recorded failure is a predicate's, but run.json names no "
                              "predicate replay can import (it was not a module-level function when recorded): "
                              "replay cannot check this failure, so it can neither reproduce nor pass. Record again "
                              "with a module-level predicate.",
                              [{"file": "run.json", "problem": "refs.predicates names no importable predicate"}])
        self.monitor = Monitor(state, DetectSettings(**detect), predicates)
        self.monitor.replaying = True
        self._stack.callback(self.monitor.close)

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def drop_code_copy(self) -> None:
        """Remove the private copy of the code snapshot now (after the session closed; nothing imports it then)."""
        if self._code_copy is not None:
            self._code_copy()

    def _read_steps_ahead(self) -> None:
        """Read the window's batches on a thread while the state is read: the first :meth:`inputs` takes them."""
        pool = ThreadPoolExecutor(1, thread_name_prefix="reprokit-steps")
        self._steps_ahead = pool.submit(lambda: {k: self.bundle.step(k) for k in self.bundle.steps})
        pool.shutdown(wait=False)
        self._stack.callback(self._take_steps_ahead)  # the thread is done before the session is

    def _take_steps_ahead(self) -> dict[int, Any]:
        ahead, self._steps_ahead = self._steps_ahead, None
        if ahead is None or ahead.exception() is not None:
            return {}  # a step that cannot be read raises where it is asked for, as it always did
        return ahead.result()

    def inputs(self, steps: Sequence[int] | None = None) -> list[StepInput]:
        """The recorded steps of the window (all, or those listed)."""
        ahead: dict[int, Any] = self._take_steps_ahead()
        out = []
        for k in steps if steps is not None else self.bundle.steps:
            batch, rng, rng_tensors = ahead[k] if k in ahead else self.bundle.step(k)
            out.append(StepInput(k, batch, rng, rng_tensors))
        return out

    def restore(self, snapshot: tuple[dict, dict] | None = None) -> None:
        """Put model/optimizer/scheduler/scaler/RNG/monitor back to a snapshot (default: the bundle's), and the
        model's non-persistent buffers to what the snapshot holds (one :meth:`capture` took) or else what ``build``
        made."""
        assert self.state is not None, "use Session as a context manager"
        tree, tensors = snapshot or self.snapshot
        owned: set[str] = set()
        preload, self._preload = self._preload, None  # used once, by the first restore: then the GPU memory is free
        if preload is not None and (snapshot is None or snapshot is self.snapshot) and preload.fits(self.state):
            on_device = preload.take()
            tensors, owned = {**tensors, **on_device}, set(on_device)
            del on_device  # restore_state drops the model's copies as soon as they are loaded
        restore_state(self.state, tree["state"], tensors, owned=owned)
        buffers = tree["state"].get(BUFFERS)  # in the snapshots capture() takes
        put_buffers(self.state.model, self._built_buffers if buffers is None else pytree.decode(buffers, tensors))
        restore_rng(tree["rng"], tensors, self.state.extra)
        self.monitor.load_state_dict(tree.get("monitor", {}))
        for change in self.after_restore:
            change(self.state)

    def _drop_preload(self) -> None:
        self._preload = None

    def run(self, steps: Sequence[StepInput], snapshot: tuple[dict, dict] | None = None,
            restore: bool = True) -> RunOutcome:
        """Restore the snapshot (unless ``restore=False``: go on from the live state), then run ``steps``
        in order until one fails."""
        if restore:
            self.restore(snapshot)
        losses: dict[int, float | None] = {}
        failure = None
        t0 = time.perf_counter()
        for inp in steps:
            restore_rng(inp.rng, inp.rng_tensors, self.state.extra if self.state else None)
            # A fresh copy every run: a step that edits its batch in place must not change the next replay.
            batch = self.fresh_batch(inp.batch)
            if self.on_step is not None:
                self.on_step("started", inp.step, None)
            result = self.monitor.run(self.step_fn, batch, inp.step)
            losses[inp.step] = result.loss
            if self.on_step is not None:
                self.on_step("finished", inp.step, result.loss)
            if result.failure is not None:
                failure = result.failure
                if self.recorded.kind == FailureKind.DEVICE_ERROR and self.device.type == "cuda" and \
                        world_size() == 1:
                    # No process group of more ranks (no peer's collective to wait for): the device error behind
                    # the exception, if any. Other bundles keep the exception as it was raised (their recorded one).
                    failure = device_error.behind(failure, lambda: torch.cuda.synchronize(self.device))
                break
        # Reproduced = the recorded signature at the recorded step; the same kind of failure
        # three steps early is another failure (another bug, or the same one under other numerics).
        return RunOutcome(failure, device_error.reproduces(self.recorded, failure, self.device.type), losses,
                          time.perf_counter() - t0)

    def fresh_batch(self, batch: Any) -> Any:
        """A copy of a recorded batch for one run, its tensors on the replay's device."""
        return _fresh_batch(batch, self.device)

    def capture(self, copy: pytree.TensorCopy | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
        """The live state as a snapshot in the bundle's ``state/`` format (``copy``: how each tensor is copied;
        by default into host memory)."""
        assert self.state is not None, "use Session as a context manager"
        tree, tensors = capture_state(self.state, copy)
        buffers = volatile_buffers(self.state.model)
        if buffers:
            tree[BUFFERS], _ = pytree.encode(buffers, BUFFERS, tensors=tensors)
        rng_tree, rng_tensors = capture_rng(self.state.extra)
        return {"state": tree, "rng": rng_tree, "monitor": self.monitor.state_dict()}, {**tensors, **rng_tensors}

    def advance(self, steps: Sequence[StepInput],
                snapshot: tuple[dict, dict] | None = None) -> tuple[dict, dict[str, torch.Tensor]] | None:
        """Run ``steps`` from a snapshot and capture the state after them; None if any step failed."""
        outcome = self.run(steps, snapshot)
        if outcome.failure is not None:
            return None
        snap = self.capture()
        snap[0]["step"] = steps[-1].step + 1 if steps else (snapshot or self.snapshot)[0].get("step")
        return snap

    def fidelity(self, outcome: RunOutcome) -> dict[str, Any]:
        """Replayed vs recorded per-step losses: bit-exact, or how far off and from which step.

        ``max_abs_diff`` is over steps where both losses are finite; ``first_diverging``
        names the first step whose losses differ at all (NaN vs a number included).
        ``hint`` says what commonly breaks bit-exactness when the bundle's own code was
        replayed on the device it was recorded on (elsewhere small differences are expected).
        """
        return loss_fidelity(self.bundle, outcome.losses, same_device=self.same_device(),
                             same_code=self.user_code is None)

    def same_device(self) -> bool:
        """Is this replay on the kind of device (and, for CUDA, the GPU model) the bundle was recorded on?"""
        try:
            recorded = torch.device(str(self.bundle.run.get("device", "cpu")))
        except RuntimeError:
            return False
        if recorded.type != self.device.type:
            return False
        if self.device.type != "cuda":
            return True
        names = self.bundle.env.get("devices") or []
        index = recorded.index or 0
        return index < len(names) and names[index] == torch.cuda.get_device_name(self.device)


def loss_fidelity(bundle: Bundle, losses: dict[int, float | None], *, same_device: bool,
                  same_code: bool) -> dict[str, Any]:
    """:meth:`Session.fidelity` of a run's ``losses``, where the run's session is elsewhere (a child process):
    ``same_device`` and ``same_code`` say what :meth:`Session.same_device` and ``--code`` said there."""
    recorded = {h["step"]: h["loss"] for h in bundle.run.get("history", [])}
    compared, first, max_diff = 0, None, 0.0
    for k, v in losses.items():
        a = recorded.get(k)
        if a is None or v is None:
            continue
        a = float(a)
        compared += 1
        if first is None and not _same_float(a, v):
            first = {"step": k, "recorded": a, "replayed": v}
        if math.isfinite(a) and math.isfinite(v):
            max_diff = max(max_diff, abs(a - v))
    exact = compared > 0 and first is None
    return {"steps_compared": compared, "max_abs_diff": max_diff, "bit_exact": exact,
            "first_diverging_step": first["step"] if first else None, "first_diverging": first,
            "recorded_device": str(bundle.run.get("device", "cpu")), "same_device": same_device,
            "same_code": same_code,
            "hint": NOT_BIT_EXACT_HINT if same_device and same_code and compared and not exact else None}


_CHECK_OF_KIND: dict[str, str] = {FailureKind.NONFINITE_LOSS: "check_loss", FailureKind.NONFINITE_GRAD: "check_grads",
                                   FailureKind.NONFINITE_PARAM: "check_params"}


def _recorded_check(recorded: Failure) -> dict[str, bool]:
    """The detector that found the recorded failure, switched on whatever run.json says: the recorder had it on
    (it fired), so a bundle with it off was edited, and replaying it off would call a failure that recurs fixed."""
    key = _CHECK_OF_KIND.get(recorded.kind)
    return {key: True} if key else {}


def _fresh_batch(obj: Any, device: torch.device | None) -> Any:
    """A copy of a recorded batch for one run: tensors copied to ``device`` (None: each on its own device), numpy
    arrays copied (decoded, they are views of the stored tensors), containers rebuilt."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device or obj.device, copy=True)
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return {k: _fresh_batch(v, device) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(_fresh_batch(v, device) for v in obj)
    if isinstance(obj, list):
        return [_fresh_batch(v, device) for v in obj]
    return obj


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


_OPT_STATE = re.compile(re.escape(OPTIMIZER) + r"/state/\d+/([^/]+)")


class _Preload:
    """The snapshot's model and optimizer tensors, copied to the GPU while the rest of the state is still read.

    Without it the first restore copied the whole state from host memory after the load (GPT-2-124M on an H200:
    ~0.45 s, 17 training steps, before the first replayed step). Here each state file's tensors go to the device as
    soon as that file is verified (:meth:`Bundle.state`'s ``on_part``), and the first :meth:`Session.restore` uses
    these copies: the model's are copied into the parameters and dropped, the optimizer's handed over as they are
    (nothing else holds them). Later restores read host memory.

    GPU memory: from the load until the model is restored, the device holds the parameters, a copy of the model's
    state and the optimizer's state, one model's size more than the host path's peak (which held the model's copies
    and the optimizer's state at different times). A training step with every parameter trained holds as much (its
    gradients, beside the same parameters and optimizer state) and more (activations).

    Only where the result is the host path's by construction: one CUDA device for every parameter and buffer, no
    sharded or referenced state, and an optimizer that loads with ``torch.optim.Optimizer.load_state_dict``, which
    moves a parameter's floating-point state (not its ``step``) to the parameter's device anyway; checked again at
    the restore. A copy that fails (out of GPU memory) drops the preload; the restore then reads host memory.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._tensors: dict[str, torch.Tensor] = {}
        self.error: BaseException | None = None
        """Why a copy failed (the preload was dropped then); None otherwise."""
        self._lock = threading.Lock()

    @classmethod
    def make(cls, state: TrainState, bundle: Bundle, device: torch.device) -> _Preload | None:
        if device.type != "cuda" or REPLICATED in bundle.manifest["files"]:
            return None
        # A sharded (FSDP2) state needs DTensors, which _one_cuda_device refuses; shards restored into plain
        # tensors are refused by the restore whichever way the tensors came.
        dev = _one_cuda_device(state)
        return None if dev is None else cls(dev)

    def fits(self, state: TrainState) -> bool:
        """The live state still is what :meth:`make` saw (checked again at the restore)."""
        return self.error is None and _one_cuda_device(state) == self.device

    def wants(self, key: str, t: torch.Tensor) -> bool:
        if key.startswith(MODEL + "/"):
            return key.count("/") == 1  # a state_dict entry itself (nested extra state stays where the host path puts it)
        m = _OPT_STATE.fullmatch(key)
        return m is not None and m.group(1) != "step" and t.is_floating_point() and t.numel() > 1

    def __call__(self, part: dict[str, torch.Tensor]) -> None:
        if self.error is not None:
            return
        try:
            copies = {k: t.to(self.device) for k, t in part.items() if self.wants(k, t)}
            torch.cuda.current_stream(self.device).synchronize()
        except Exception as e:  # out of GPU memory, most likely: the restore copies from host memory instead
            with self._lock:
                self.error = e
                self._tensors = {}
            return
        with self._lock:
            if self.error is None:
                self._tensors.update(copies)

    def take(self) -> dict[str, torch.Tensor]:
        """The copies, handed over (this object keeps none)."""
        with self._lock:
            out, self._tensors = ({} if self.error is not None else self._tensors), {}
            return out


def _one_cuda_device(state: TrainState) -> torch.device | None:
    """The CUDA device every parameter, buffer and optimizer parameter is on (plain tensors, no DTensors), where the
    optimizer loads its state with ``torch.optim.Optimizer.load_state_dict``; else None."""
    opt = state.optimizer
    if type(opt).load_state_dict is not torch.optim.Optimizer.load_state_dict:
        return None
    live = [*state.model.parameters(), *state.model.buffers(), *(p for g in opt.param_groups for p in g["params"])]
    if not live or live[0].device.type != "cuda" or any(
            type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device != live[0].device for t in live):
        return None  # several devices, or DTensors (FSDP2): the restore places each tensor itself
    return live[0].device


@contextmanager
def session(bundle: str | Path | Bundle, **kw: Any) -> Iterator[Session]:
    b = bundle if isinstance(bundle, Bundle) else open_bundle(bundle)
    with Session(b, **kw) as s:
        yield s


def replay_isolated(bundle: Any, *, times: int = 1, device: str | None = None, code: str | Path | None = None,
                    progress: Any = None) -> Any:
    """:func:`replay` with each run in a child process (see :mod:`reprokit.isolation`).

    A run whose child died is a ``crash`` at the step it started last: it reproduces a recorded crash that died the
    same way there (the same signal; any signal when the bundle recorded none; the same exception class for a death
    by an uncaught exception), and a recorded device error of the same exception class. Deterministic and flaky are
    told apart over ``times`` runs as in-process. ``report.isolation`` says what isolation cost and, for a crash
    that replays clean, what that means, with the peak host memory of a run beside the recorded machine's memory.
    """
    runs, attempts = [], []
    with IsolatedRunner() as runner:
        for i in range(times):
            a = runner.attempt(bundle.path, recorded=bundle.failure, device=device, code=code)
            attempts.append(a)
            runs.append(a.outcome)
            if progress:
                progress(i + 1, times)
    seen = next((a for a in attempts if a.device is not None), None)
    for a in attempts:
        a.outcome.fidelity = loss_fidelity(bundle, a.outcome.losses, same_device=bool(seen and seen.same_device),
                                           same_code=code is None)
    where = seen.device if seen else device or default_device(bundle)
    label = seen.code if seen and seen.code else code_label(bundle, Path(code).resolve() if code else None)
    report = report_of(bundle, runs, str(where), label)
    report.isolation = isolation_summary(report, attempts, runner.summary(), bundle.env)
    return report


def replay_device_error(bundle: Bundle, *, times: int = 1, device: str | None = None, code: str | Path | None = None,
                        progress: Any = None) -> ReplayReport:
    """:func:`replay` of a ``device_error`` bundle: on the CPU first, the culprit named, then the GPU where there is
    one (see :mod:`reprokit.triage`).

    ``device``: ``"cpu"`` keeps the whole replay on the CPU (the verdict is the CPU face's); else the GPU confirms
    where torch sees one. Returns a :class:`ReplayReport` whose ``triage`` says what each part
    found.
    """
    gpu = torch.cuda.is_available() and device != "cpu"
    if not gpu:
        report, found = _device_error_on_cpu(bundle, times, code, progress)
        found["gpu"] = {"checked": False, "why_not": "--device cpu was asked for" if device == "cpu" else
                        "no CUDA device here"}
        found["reproduced_as"] = "cpu_face" if report.reproduced else None
        report.triage = found
        return report
    cpu = triage.cpu_in_child(bundle, code)
    report = replay_isolated(bundle, times=times, device="cuda", code=code, progress=progress)
    first = next((r for r in report.runs if r.same), report.runs[0] if report.runs else None)
    report.triage = {**cpu, "gpu": {"checked": True, "verdict": report.verdict,
                                    "failure": first.failure.summary() if first and first.failure else None}}
    report.triage["reproduced_as"] = "device_error" if report.reproduced else None
    return report


def _device_error_on_cpu(bundle: Bundle, times: int, code: str | Path | None,
                         progress: Any) -> tuple[ReplayReport, dict[str, Any]]:
    """Every run on the CPU, in this process (no GPU here, or ``--device cpu``): the first one watched. Returns the
    report and the triage so far."""
    s = Session(bundle, device="cpu", code=code)
    try:
        with s:
            first, found = triage.watched_run(s)
            runs = [first]
            if progress:
                progress(1, times)
            inputs = s.inputs()
            for i in range(1, times):
                runs.append(s.run(inputs))
                if progress:
                    progress(i + 1, times)
            for r in runs:
                r.fidelity = s.fidelity(r)
            report = report_of(bundle, runs, "cpu", s.code_label)
    finally:
        s.drop_code_copy()
    return report, {"cpu": triage.cpu_summary(first), **found}


def replay(bundle: str | Path | Bundle, *, times: int = 1, device: str | None = None,
           code: str | Path | None = None, progress: Any = None, as_rank: bool = False,
           isolate: bool | None = None,
           on_step: Callable[[str, int, float | None], None] | None = None) -> ReplayReport:
    """Re-run a bundle's window ``times`` times and say whether it fails the same way.

    Args:
        bundle: a bundle directory (or an opened :class:`Bundle`).
        times: number of independent replays; more than one tells deterministic from flaky.
        device: ``"cpu"`` or ``"cuda"``; default: where it was recorded, if available here.
        code: a directory to import ``build``/step from instead of the bundle's snapshot
            (a fixed checkout makes the bundle pass).
        progress: optional callable ``progress(i, n)`` after each run.
        as_rank: this process is one rank of an N-rank incident replay (see
            :func:`reprokit.distributed.replay_incident`): a ``peer`` bundle is run too.
        isolate: run each replay in a child process, so that a step that kills the process (a segfault, an
            abort, a poisoned CUDA context) ends the child and not this one (see :mod:`reprokit.isolation`).
            Default (None): for a bundle whose failure is a ``crash`` or ``device_error``; a rank of an incident
            replay is a child process already.
        on_step: for a replay in this process (not isolated), called as each step starts and finishes (see
            ``Session.on_step``): a rank of an incident replay writes them where its supervisor finds them if the
            step kills the process.

    Returns:
        A :class:`ReplayReport`; ``report.verdict`` is the headline: ``deterministic``,
        ``flaky``, ``different_failure`` (failed, but not with the recorded signature at
        the recorded step) or ``not_reproduced``.

    Example:
        >>> report = replay("repros/bundle-...", times=3)                   # doctest: +SKIP
        >>> report.verdict                                                   # doctest: +SKIP
        'deterministic'
    """
    if times < 1:
        raise ConfigError.option("times", f"{{opt}} must be >= 1, got {times}")
    bundle = bundle if isinstance(bundle, Bundle) else open_bundle(bundle)
    if not as_rank:  # one rank of an N-rank incident replay runs a peer's window too: its collectives need it
        _refuse_peer(bundle)
        if bundle.failure.kind == FailureKind.DEVICE_ERROR and not isolate:
            return replay_device_error(bundle, times=times, device=device, code=code, progress=progress)
        if isolate or (isolate is None and bundle.failure.kind in DEATHS):
            return replay_isolated(bundle, times=times, device=device, code=code, progress=progress)
    s = Session(bundle, device=device, code=code, preload=True)
    s.on_step = on_step
    try:
        with s:
            return _replay_runs(s, times, progress)
    finally:
        s.drop_code_copy()  # now, not at garbage collection: a rank's process leaves with os._exit


def _replay_runs(s: Session, times: int, progress: Any) -> ReplayReport:
    """The runs of :func:`replay` in an entered session, and their report."""
    inputs = s.inputs()
    runs = []
    for i in range(times):
        runs.append(s.run(inputs))
        if progress:
            progress(i + 1, times)
    for r in runs:
        r.fidelity = s.fidelity(r)
    return report_of(s.bundle, runs, str(s.device), s.code_label)


def report_of(bundle: Bundle, runs: list[RunOutcome], device: str, code_label: str,
              isolation: dict[str, Any] | None = None) -> ReplayReport:
    """The report of ``runs`` (each with its ``fidelity`` set) of ``bundle``'s window, replayed on ``device`` from
    the code ``code_label`` names."""
    fidelity = dict(runs[0].fidelity or {})  # the report's: the first run's, and whether the others match it
    fidelity["runs_bit_identical"] = all(
        r.losses.keys() == runs[0].losses.keys()
        and all(_same_float(a, b) for a, b in zip(r.losses.values(), runs[0].losses.values())
                if a is not None and b is not None)
        for r in runs[1:])
    return ReplayReport(bundle.path, bundle.failure, runs, fidelity, device, code_label,
                        bundle.run.get("distributed"), isolation)


def foreign_code_note(bundle: Bundle, archive: bool, code: str | Path | None = None) -> str | None:
    """One line saying that replaying runs the bundle's code, for a bundle that came from elsewhere (a packed
    archive, or recorded on another host); None for a bundle this machine recorded, or replayed with ``code``
    (``--code``: the user's own checkout)."""
    host = bundle.env.get("host")
    if code is not None or (not archive and host == platform.node()):
        return None
    where = "a packed archive" if archive else f"recorded on {host}" if host else "recorded on another machine"
    code = ("the modules installed here, as run.json names them (the bundle has no code snapshot)"
            if bundle.code_dir is None else f"its code snapshot ({bundle.code_dir.name}/)")
    return (f"reprokit: replaying runs code: build() and the step function are imported from {code}; this bundle "
            f"is {where}. Run bundles you would run yourself (`reprokit inspect` shows what it imports; --trust or "
            "REPROKIT_REPLAY_TRUST=1 silences this note).")


_PEER_LOST = ("connection closed by peer", "connection reset by peer", "remote worker crashing",
              "remote process exited", "communicator was aborted", "nccl watchdog")
"""Words of gloo's and NCCL's errors when another rank's process went away mid-collective."""


def lost_peer(bundle: Bundle) -> bool:
    """The recorded failure is a collective that lost a peer: another rank's process ended (outside its recorded
    steps, or it would have declared the incident) and this rank's collective failed for it."""
    f = bundle.failure
    if f.kind != FailureKind.EXCEPTION or _world_size(bundle) < 2:
        return False
    # gloo raises a plain RuntimeError, NCCL a DistBackendError (a RuntimeError); an OSError such as a data
    # loader's ConnectionResetError ("Connection reset by peer") is the step's own failure, not a lost rank.
    return f.exc_type in ("RuntimeError", "DistError", "DistBackendError", "DistNetworkError") and any(
        s in f.message.lower() for s in _PEER_LOST)


def _world_size(bundle: Bundle) -> int:
    """The recorded world size; 1 for a bundle of one process (or one whose ``distributed`` says no number)."""
    dist = bundle.run.get("distributed")
    n = dist.get("world_size") if isinstance(dist, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) else 1


def _lost_peer_words(bundle: Bundle) -> str:
    dist = bundle.run.get("distributed") or {}
    return (f"rank {dist.get('rank', '?')}'s recorded failure is a collective that lost a peer "
            f"({bundle.failure.describe()}): another rank's process ended, outside the steps it recorded (else it "
            "would have written its own bundle), so the cause is in that rank's own output, not in this bundle. "
            "Replayed without it, nothing can fail that way, and \"not reproduced\" would say nothing about a fix.")


def _refuse_peer(bundle: Bundle) -> None:
    """A rank that did not fail itself has nothing to reproduce alone: point at the rank that failed."""
    f = bundle.failure
    if lost_peer(bundle):
        raise ReprokitError(f"{bundle.path.name}: {_lost_peer_words(bundle)} Look for the error that ended the other "
                            "rank in the job's log (torchrun prints each rank's traceback).")
    if f.kind != FailureKind.PEER:
        return
    doc = f.detail.get("incident", {}) if isinstance(f.detail, dict) else {}
    dist = bundle.run.get("distributed") or {}
    raise ReprokitError(
        f"{bundle.path.name} is rank {dist.get('rank', '?')}'s window of {doc.get('incident', 'an incident')}: this "
        f"rank did not fail itself, rank {doc.get('rank', '?')} did at step {doc.get('step', '?')} "
        f"({doc.get('what', '')}). Replay that rank's bundle, or the whole incident on as many ranks: "
        f"`reprokit replay {bundle.path.parent} --nproc {dist.get('world_size', 'N')}`.")


def as_train_state(state: Any) -> TrainState:
    """What ``build`` returned, as this reprokit's :class:`TrainState`.

    A checkout can carry its own copy of reprokit (``bisect commits`` and ``--code`` replay the project's code, and
    a project may vendor reprokit or be reprokit): its ``TrainState`` is another class with the same fields. That
    one is taken over field by field; anything else is refused, naming what it was.

    Raises:
        CodeLoadError: ``state`` is not a TrainState of any copy of reprokit.
    """
    if isinstance(state, TrainState):
        return state
    cls = type(state)
    names = [f.name for f in dataclasses.fields(TrainState)]
    if cls.__name__ == "TrainState" and dataclasses.is_dataclass(state) and \
            [f.name for f in dataclasses.fields(state)] == names:
        return TrainState(**{n: getattr(state, n) for n in names})
    raise CodeLoadError(
        f"build(config) must return a reprokit.TrainState, got {cls.__module__}.{cls.__qualname__}"
        + (" (a TrainState whose fields differ from this reprokit's: a copy of reprokit of another version; replay "
           "with the reprokit the bundle was recorded with)" if cls.__name__ == "TrainState" else ""))


def alone_hint(bundle: Bundle) -> str:
    """What to try when a bundle's failure did not reproduce: a rank replayed alone needs its peers; else flakiness."""
    dist = bundle.run.get("distributed") or {}
    if lost_peer(bundle):
        return _lost_peer_words(bundle)
    if _world_size(bundle) > 1:
        return (f"It was recorded on rank {dist.get('rank')} of {dist['world_size']} and replayed alone: collectives "
                "see one rank, so a failure that came from the other ranks' data cannot happen here. Replay the "
                f"incident on {dist['world_size']} ranks (`reprokit replay {bundle.path.parent} --nproc "
                f"{dist['world_size']}`) and shrink or bisect the rank whose failure reproduces alone.")
    return "Run `reprokit replay --times 5` to see whether it is flaky."


def not_reproduced_note(bundle: Bundle) -> str:
    """The line a bisect prints when the recorded failure did not happen in its replay."""
    return (f"the recorded failure ({bundle.failure.describe()}) did NOT reproduce in this replay, so nothing above "
            f"localises it. {alone_hint(bundle)}")


def _refuse_shards_alone(bundle: Bundle) -> None:
    """A rank's shards of a sharded (FSDP2) state mean nothing without the other ranks': replay them together."""
    shards = bundle.state_tree().get("state", {}).get(SHARDS)
    if not shards:
        return
    mesh = next(iter(shards.values())).get("mesh_shape", ["?"])
    ranks = 1
    for n in mesh:
        ranks *= n if isinstance(n, int) else 1
    world = world_size()
    if world != ranks:
        dist = bundle.run.get("distributed") or {}
        where = bundle.path.parent if dist else "the incident folder"
        raise StateMismatchError(
            f"{bundle.path.name} holds one rank's shards of a sharded (FSDP2) state, recorded on a mesh of {mesh} "
            f"ranks; this process is a world of {world}. Replay the incident on as many ranks: "
            f"`reprokit replay {where} --nproc {ranks}`.")


def format_report(d: dict[str, Any]) -> str:
    """The human summary of ``ReplayReport.to_json()`` that ``reprokit replay`` prints.

    Every verdict comes with both failures (when they differ), the fidelity of the
    losses (bit-exact, or the largest difference and the first step that diverged),
    and, with ``--times N``, each run's outcome and failure step.
    """
    rec, got, verdict = d["recorded_failure"], d["failure"], d["verdict"]
    counts = f"{d['failed_runs']}/{d['runs']} runs failed the same way at the same step"
    if d.get("different_runs"):
        counts += f", {d['different_runs']} failed differently"
    lines = [f"{VERDICT_HEADLINES[verdict]}: {counts} ({verdict_phrase(verdict, d['runs'])})",
             f"  recorded: {fail_line(rec)}"]
    if got and not d["reproduced"]:
        lines.append(f"  replay hit a DIFFERENT failure: {fail_line(got)}")
        if got["step"] != rec["step"]:
            lines.append(f"    (reproduced means the same failure at step {rec['step']}; "
                         f"this one fired at step {got['step']})")
    elif got:
        lines.append(f"  replayed: {fail_line(got)}")
    lines += triage.triage_lines(d.get("triage"), rec["step"] if rec else None)
    lines.append(f"  fidelity: {fidelity_line(d['fidelity'], rec['step'] if rec else None)}")
    lines += isolation_lines(d.get("isolation"))
    if d.get("transient"):
        lines.append(f"  note: {TRANSIENT_NOTE}")
    dist = d.get("distributed") or {}
    n = dist.get("world_size") if isinstance(dist, dict) else None
    alone = isinstance(n, int) and n > 1
    # The hint's causes (a generator, state edited in the loop, a kernel) are not what a transient failure or a rank
    # replayed without its peers point to: their own notes say what does.
    if d["fidelity"].get("hint") and not d.get("transient") and not alone:
        lines.append(f"  hint: {d['fidelity']['hint']}")
    if d["runs"] > 1:
        lines.append("  runs:")
        lines += [f"    {i}: {_run_line(r)}" for i, r in enumerate(d["per_run"], 1)]
    lines.append(f"  device {d['device']}, code from {d['code']}")
    if alone:
        lines.append(f"  note: recorded on rank {dist['rank']} of {dist['world_size']}, replayed alone: collectives see "
                     "one rank, so a failure that needs the other ranks' data may not reproduce")
    return "\n".join(lines)


def fidelity_line(fid: dict[str, Any], failing_step: int | None = None) -> str:
    """``bit-exact over N step losses``, or the largest difference and the first step that diverged (said as such
    when that is the recorded failing step: every loss before it was bit-exact)."""
    n = fid["steps_compared"]
    if not n:
        return "no step losses to compare (the replay recorded none that the bundle has)"
    losses = f"{n} step loss{'es' if n != 1 else ''} compared"
    if fid["bit_exact"]:
        out = f"bit-exact ({losses})"
    else:
        first = fid.get("first_diverging") or {"step": fid["first_diverging_step"]}
        values = f" (recorded {_num(first['recorded'])}, replayed {_num(first['replayed'])})" \
            if "recorded" in first else ""
        # Over finite losses only: a NaN against a number shows in the first diverging step instead.
        diff = f"max abs loss diff {fid['max_abs_diff']:.3g}, " if fid["max_abs_diff"] else ""
        if first["step"] == failing_step and n > 1:
            out = f"bit-exact before the failing step {failing_step}, which differs{values}; {losses}"
        else:
            out = f"NOT bit-exact: {diff}first diverged at step {first['step']}{values}; {losses}"
    if fid.get("runs_bit_identical") is False:
        out += "; runs differ from each other"
    return out


def _num(x: Any) -> str:
    return f"{x:.7g}" if isinstance(x, float) else str(x)  # JSON carries NaN / inf as strings


def _run_line(r: dict[str, Any]) -> str:
    f = r["failure"]
    if r["verdict"] == "reproduced":
        out = f"reproduced at step {r['failure_step']}"
    elif r["verdict"] == "different_failure":
        out = f"different failure at step {r['failure_step']}: {summary_line(f, frame=False, step=False)}"
    else:
        out = f"passed {r['steps_run']} step{'' if r['steps_run'] == 1 else 's'}"
    fid = r.get("fidelity") or {}
    if fid.get("first_diverging_step") is not None:
        out += f"; losses diverged at step {fid['first_diverging_step']}"
    elif fid.get("bit_exact"):
        out += "; losses bit-exact"
    return f"{out} ({r['seconds']:.2f}s)"


def fail_line(f: dict[str, Any] | None) -> str:
    """One line for a failure summary (see :func:`reprokit.signature.summary_line`)."""
    return summary_line(f)
