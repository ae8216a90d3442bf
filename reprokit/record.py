"""The Recorder: watch every training step, keep a replayable window, dump it on failure.

Cost model: every step records the batch and the RNG state; every ``snapshot_every``
steps the full state is copied to host memory and the window restarts. On a
failure the window is written as a bundle. Faults of the recorder itself only
warn: it never changes training results and never raises its own errors into
the loop.

Batches: every tensor of a batch is copied at step start, before the step can run, into a
host buffer reused window after window (for a CUDA tensor: device to pinned host memory on the
training stream, so that the step's own kernels, and anything that writes the batch later, are
ordered after the copy). A recording therefore holds exactly the bytes each step consumed,
whatever the loader does with its buffers afterwards (refilling them through a numpy view or
``.data``, reusing pinned memory): nothing relies on version counters. Copying costs a host
``memcpy`` per step (~0.05 ms per MB into a reused buffer on a CPU host,
``bench/memory_budget.py``); for CUDA batches one asynchronous copy per leaf at step start.

The failures that kill the GPU (a device-side assert: every later CUDA call fails, see
:mod:`reprokit.device_error`): every byte a bundle needs is in host memory before the step's
kernels run, and the recorder knows what landed without asking the device. After each step's
batch copies a marker (:class:`~reprokit.device_error.HostMarker`) is copied into pinned host memory on
the same stream; the snapshot engine marks each snapshot's copies the same way, and keeps the
previous snapshot (and the recorder the previous window's batches) until the new one is known
complete. On a sticky error the bundle is written from host memory alone (:meth:`Recorder._dump`).

Memory: the snapshot, the batch buffers and the window's RNG reads stay within
``host_memory_budget`` (early snapshots, else a spill to disk; see :meth:`Recorder.stats`).

Checks: the recorder never makes the host wait for the device to judge a step. Each step's loss and norms are
copied to the host without a wait and judged once they have landed (:mod:`reprokit.lag`), up to ``max_lag`` steps
later; a failure is attributed to the step whose values fired, and its window ends there. Because a snapshot
replaces the window, it is taken only once every earlier step is judged clean (see :meth:`Recorder._checks_settled`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import os
import shlex
import sys
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reprokit import device_error, late_device_errors, pytree, skip
from reprokit.batch_pool import BatchPool
from reprokit.bundle import (
    BundleWriter,
    StepRecord,
    find_leftovers,
    write_bundle,
    write_probe,
)
from reprokit.bundle.layout import bundle_name
from reprokit.bundle.tensorfile import WrittenFile
from reprokit.code import importing_for_replay, ref_of, relative, snapshot_files
from reprokit.detect import DetectSettings, Monitor, Predicate, StepResult
from reprokit.diagnose import failure_note, model_tables
from reprokit.distributed import IncidentBoard, nccl_aborts_on_device_errors, rank_info, replicated, sees_rank0
from reprokit.distributed import abort as fail_fast
from reprokit.distributed.peers import PEER_TIMEOUT_S, PeerWatch
from reprokit.distributed.rank_incidents import RankIncidents
from reprokit.env import capture_env, determinism_flags, split_flags
from reprokit.errors import CaptureError, CodeLoadError, ConfigError, RecorderWarning, TrainingFailure
from reprokit.flight import FlightLog
from reprokit.flight import run_id as flight_run_id
from reprokit.rng import RNGState, check_generators, host_format_problem
from reprokit.rng import capture as capture_rng
from reprokit.rng import encode as encode_rng
from reprokit.signature import Failure, FailureKind, from_exception
from reprokit.snapshot import SnapshotEngine, mib
from reprokit.state import TrainState, accumulation_phase, capture_state, check_scaler_layout

StepFn = Callable[[TrainState, Any], Any]

SPILL_DIR = ".reprokit-spill"
RNG_STEP_BYTES = 40 << 10
"""Host memory of one step's RNG reads (python's 625-int tuple is most of it), counted against the budget."""


def default_host_budget() -> int:
    """A quarter of the machine's RAM or half of what is available now, whichever is less, per local rank."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    available = total
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return int(min(total // 4, available // 2) // local)


def _batch_bytes(batch: Any) -> tuple[int, int]:
    """(bytes of the batch's tensors, bytes of its numpy arrays): what recording the batch will hold."""
    tensors = arrays = 0
    todo = [batch]
    while todo:
        obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            tensors += obj.numel() * obj.element_size()
        elif isinstance(obj, np.ndarray):
            arrays += obj.nbytes
        elif isinstance(obj, dict):
            todo.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
    return tensors, arrays




def _plain(x: Any) -> float | None:
    """A loss or norm as a JSON number (a tensor that is not resolved yet, or anything else: None)."""
    return float(x) if isinstance(x, (int, float)) else None


def _lr_and_scale(state: TrainState, read_scale: float | None = None) -> tuple[float | None, float | None]:
    """The first param group's LR and the GradScaler's scale after a step, for ``inspect --plot``.

    Read only where it costs no device sync: a tensor LR is left out (None); a scale on a GPU is the one the
    detector fetched with the loss this step (``read_scale``), else left out.
    """
    try:
        lr = state.optimizer.param_groups[0].get("lr")
        lr = float(lr) if isinstance(lr, (int, float)) else None
        scale = getattr(state.scaler, "_scale", None) if state.scaler_enabled() else None
        if isinstance(scale, torch.Tensor) and not scale.is_cuda:
            return lr, float(scale)
        return lr, read_scale if state.scaler_enabled() else None
    except Exception:  # never let a read for a plot stop the run
        return None, None


MAX_LAG = 8
"""The default ``max_lag``: how many steps a step's checks may be judged after it (see :class:`Recorder`)."""


@dataclass(slots=True)
class _Step:
    """One recorded step, as kept in the window: its batch copied, its RNG as read (encoded at dump)."""

    step: int
    batch: Any
    tensors: dict[str, torch.Tensor]
    rng: RNGState
    other_bytes: int = 0
    """Host bytes held outside the batch-buffer pool (RNG states, numpy leaves)."""
    loss: float | None = None
    grad_norm: float | None = None

    def record(self, host_only: bool = False, cuda_rng: bool = True) -> StepRecord:
        rng_tree, rng_tensors = encode_rng(self.rng, host_only=host_only, cuda=cuda_rng)
        return StepRecord(self.step, self.batch, {**self.tensors, **rng_tensors}, rng_tree, self.loss,
                            self.grad_norm)


@dataclass
class _Snapshot:
    step: int
    tree: dict[str, Any]
    tensors: dict[str, torch.Tensor] | list[WrittenFile]
    """In host memory, or safetensors files (with their digests) when spilling to disk."""
    referenced: bool = False
    """Only this rank's RNG and detector state: model and optimizer state are rank 0's (replicated_state)."""
    serial: int = 0
    """The snapshot engine's number for it (:meth:`SnapshotEngine.complete` says whether its copies landed)."""


@dataclass
class _Kept:
    """The previous window, kept while the snapshot that replaced it may still be copying (a device error then
    leaves it the one complete window): its snapshot, its steps, their host bytes outside the batch pool."""

    snapshot: _Snapshot
    ring: list[_Step]
    other: int


def cuda_devices(devices: Iterable[torch.device], current: int) -> list[int]:
    """The CUDA device indices among ``devices``, sorted, each once; a ``cuda`` device without an index is
    ``current``. These are the devices a bundle write waits on: synchronising a device this process never used
    would create a CUDA context there (about 500 MiB of that GPU's memory, under torchrun on every rank).

    Example:
        >>> cuda_devices([torch.device("cpu"), torch.device("cuda", 1), torch.device("cuda")], current=0)
        [0, 1]
    """
    return sorted({current if d.index is None else d.index for d in devices if d.type == "cuda"})


def _add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (Python 3.11+). Python 3.10 has no ``add_note``: the note goes into the same
    ``__notes__`` list (where code and tests read it), and to stderr, since 3.10's traceback does not print notes."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
        return
    try:
        setattr(exc, "__notes__", [*getattr(exc, "__notes__", []), note])  # noqa: B010 (3.10 knows no such attribute)
    except Exception:  # an exception type that refuses new attributes: stderr still says it
        pass
    print(note, file=sys.stderr)


class Recorder:
    """Watch a training loop and write a bundle when it fails.

    Args:
        state: the :class:`TrainState` your loop trains.
        train_step: ``train_step(state, batch) -> loss``, a module-level function.
        build: ``build(config) -> TrainState``, a module-level function; replay calls it.
        config: what ``build`` takes: plain data (numbers, strings, lists, dicts).
        out_dir: where bundles are written.
        snapshot_every: steps between full-state snapshots; a bundle holds at most
            this many steps.
        detect: extra predicates ``fn(step, loss, state) -> bool | str``; truthy fails. Judged at their step's
            end (one wait for the device per step), unless marked :func:`reprokit.detect.lagged` (see ``max_lag``).
        check_grads / check_params / scaler_patience / spike_factor / spike_window:
            see :class:`reprokit.detect.DetectSettings`.
        loss_history: how many recent (step, loss) pairs to keep for ``inspect``.
        spill_dir: stream snapshots to a file in this local directory instead of keeping them
            in host memory (for states that do not fit in RAM; costs a synchronous copy).
        host_memory_budget: bytes of host memory the recorder may hold: the snapshot plus the
            window's batch copies and RNG states. Default: a quarter of the machine's RAM or half
            of what is available at attach time, whichever is less, divided by the local ranks
            (``LOCAL_WORLD_SIZE``). When the window would pass it, the next snapshot is taken early
            (the window restarts; said once). A state bigger than three quarters of the budget is
            snapshotted to disk under ``out_dir/.reprokit-spill`` instead (said once, with numbers).
            Batch buffers are a pool reused window after window.
        incident_wait_s: under a process group (torchrun), how long a rank that failed waits for the other ranks
            to write their windows into the incident folder before its error is raised (see
            :mod:`reprokit.distributed`).
        on_incident: under a process group, what a rank that did not fail itself does once every rank's window is
            in the incident folder (or ``incident_wait_s`` has passed). ``"abort"`` (the default): its process
            group is aborted (``ProcessGroup.abort()``), so a collective it is blocked in returns with an error,
            and its step raises :class:`reprokit.PeerFailure` naming the incident and the rank that failed (a rank
            that was not in a collective raises it at its next step); under gloo, whose abort cannot interrupt a
            blocked call, a rank still blocked ends its own process with a line on stderr. A rank that failed
            itself raises its own error as always (under NCCL its process group is aborted too when a peer
            aborts, so that ``dist.destroy_process_group()`` in its exit path does not wait). ``"wait"``: today's
            behaviour, a blocked rank waits for the backend's timeout (NCCL's watchdog); for a loop that catches
            a failure on one rank and goes on. See :mod:`reprokit.distributed.abort`.
        replicated_state: under a process group, whether model and optimizer state are the same on every rank, so
            that only global rank 0 (the owner) snapshots them and the other ranks' bundles reference its state files
            by digest (each rank still records its own batches, RNG and detector state). ``"auto"`` (the default):
            when the model is a ``DistributedDataParallel``, the world size is above one, no parameter is a
            DTensor (FSDP2 and tensor parallel state differs per rank) and ``state.extra`` holds only generators
            (anything else there may differ per rank). This saves the state's host memory (and its
            disk) on every rank but one. A non-owner whose window cannot fit its budget, or whose gradients are not
            empty at a snapshot step (accumulation), takes its own snapshot instead (said once). ``True`` insists
            (refused where ``"auto"`` would not apply); ``False`` snapshots on every rank.
        snapshot_sync: copy CUDA state on the training stream (a stall of the state's size over
            the PCIe bandwidth at every snapshot: ~30 ms for GPT-2-124M with AdamW). By default the
            copy overlaps the forward and backward; a parameter written in place outside
            ``optimizer.step()`` during that time is seen through its version counter and the
            snapshot is retaken one step later (see :meth:`SnapshotEngine.check`). Turn this on
            when the loop writes parameters in ways version counters do not see
            (``p.data.copy_(...)``, custom kernels).
        max_lag: how many steps a step's checks (loss, gradient and parameter norms, the GradScaler's scale, lagged
            predicates) may be judged after it. The values are copied to the host without a wait and judged once
            they have landed, so the host keeps queueing steps ahead of the device as it would without the recorder;
            a check ``max_lag`` steps old is waited for (one wait on its copy's event), so a loop that never syncs
            itself still sees a failure within ``max_lag`` steps. The failure is the step whose values fired (its
            window ends there; ``rec.step`` raises where it was seen, saying both steps). A snapshot waits for every
            earlier step's check: it is postponed (the window grows by a step) while some are on their way, and after
            ``max_lag`` postponements the recorder waits for them (under ``replicated_state``, at once, so that every
            rank snapshots at the same step). Predicates not marked :func:`reprokit.detect.lagged` judge every step
            at its own end (one wait per step). 0: every step is judged at its own end. See :meth:`wait_for_checks`.
            The default is 8, and 0 with ``on_failure="skip"`` (a skip rolls the run back to the failing step,
            which must not have been followed by others: a larger ``max_lag`` is refused there).
        durable: also write the window behind to disk, under ``out_dir/.reprokit-flight/<run id>/rank<k>/``, so that
            a process that dies without a Python frame to catch anything (the OOM killer's SIGKILL, a segfault in an
            extension, an abort, a preempted node) leaves it: ``reprokit recover OUT_DIR`` turns it into a bundle
            (see :mod:`reprokit.flight`). Each step's batch and RNG state reach the log before the step runs (a CUDA
            batch: once its asynchronous copy has landed, on a writer thread); snapshots are written by that thread
            and fsynced; at most two windows are on disk. :meth:`close` (or the end of ``with Recorder(...)``, or
            the interpreter's normal exit outside a step) removes the run's flight folder. Under a process group
            every rank snapshots its own state (``replicated_state`` resolves to False). Under a process group each
            rank's incident watcher also checks its peers' flight folders: a peer killed outright (SIGKILL, the OOM
            killer, a segfault) writes no incident, so the first rank to see it dead declares one for it, every live
            rank writes its window, and ``on_incident`` applies as for a raised failure (see
            :mod:`reprokit.distributed.peers`).
        carry: classes (or module-level functions) of your project that replay must import besides ``build`` and
            ``train_step``: a model class, a ``Trainer`` or ``LightningModule`` subclass that ``build`` names through
            ``config``. Each is listed in the bundle under ``refs.objects`` (replay vets the code snapshot for them
            before importing anything), and its file travels in the code snapshot. Installed code (a stock
            transformers model) needs nothing: the environment records its version. Framework integrations pass
            their model and trainer classes here (the docs' "Writing an integration" page).
        on_failure: ``"raise"`` (the default): a failure writes its bundle and raises. ``"skip"``: after the bundle,
            the recorder replays the window in this process and, only when it proves that some rows of the failing
            batch cause the failure (it reproduces, the state passes on healthy data, the step passes without those
            rows and fails with only them), drops them, puts the state where the step leaves it without them, warns
            naming their dataset indices, appends the skip to ``out_dir/skips.jsonl`` and returns the step's loss;
            otherwise it raises as ``"raise"`` does, with a note saying why it did not skip (see
            :mod:`reprokit.skip`).
        skip_budget_s: wall-clock seconds one skip attempt may replay for (default 120); past it, the run stops.
        max_skips / skip_window: at most ``max_skips`` skips within any ``skip_window`` steps (default 3 per 1000);
            the next failure stops the run.
        skip_indices: dataset indices to keep out of this run (``reprokit.skip_list(out_dir)`` of an earlier run):
            each batch that carries a dataset index leaf (``index``, ``indices``, ``idx`` or ``sample_id``, one value
            per row) has those rows dropped before it is recorded and trained on, as the skipping run had them
            dropped. A batch without one is used as it is (said once): filter such data in your sampler.
        peer_timeout_s: with ``durable=True`` under a process group, how old the heartbeat of a peer on *another
            host* must be, while this rank waits inside one step at least as long, before that peer counts as dead
            (a peer on this host is checked at once, by its pid and its flight log's lock, with no timeout).

    Raises:
        CaptureError: at attach time, naming what cannot be recorded (a lambda as
            ``build``, a config that is not plain data, an optimizer state holding
            an unsupported object).
        ConfigError: an option with a value the Recorder cannot use (``snapshot_every=0``). A
            Recorder that raises leaves nothing attached to the optimizer.

    Example:
        >>> rec = Recorder(state, train_step, build=build, config=cfg)   # doctest: +SKIP
        >>> for batch in loader:                                          # doctest: +SKIP
        ...     loss = rec.step(batch)
    """

    def __init__(
        self,
        state: TrainState,
        train_step: StepFn,
        *,
        build: Callable[[Any], TrainState],
        config: Any = None,
        out_dir: str | Path = "repros",
        snapshot_every: int = 100,
        detect: Sequence[Predicate] = (),
        check_grads: bool = True,
        check_params: bool = False,
        scaler_patience: int = 25,
        spike_factor: float | None = None,
        spike_window: int = 50,
        loss_history: int = 1000,
        spill_dir: str | Path | None = None,
        host_memory_budget: int | None = None,
        snapshot_sync: bool = False,
        incident_wait_s: float = 60.0,
        replicated_state: str | bool = "auto",
        on_incident: str = "abort",
        durable: bool = False,
        carry: Sequence[Any] = (),
        on_failure: str = "raise",
        skip_budget_s: float = 120.0,
        max_skips: int = 3,
        skip_window: int = 1000,
        skip_indices: Iterable[Any] | None = None,
        peer_timeout_s: float = PEER_TIMEOUT_S,
        max_lag: int | None = None,
    ):
        if snapshot_every < 1:
            raise ConfigError(f"snapshot_every must be >= 1, got {snapshot_every}")
        if max_lag is None:
            max_lag = 0 if on_failure == "skip" else MAX_LAG
        if isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 0:
            raise ConfigError(f"max_lag must be a whole number of steps >= 0, got {max_lag!r}")
        if max_lag and on_failure == "skip":
            raise ConfigError.option("max_lag", f"{{opt}}={max_lag} with on_failure=\"skip\": a skip rolls the run back "
                                                "to the failing step, so every step is judged at its own end (leave "
                                                "{opt} out, or pass 0)")
        if not isinstance(peer_timeout_s, (int, float)) or isinstance(peer_timeout_s, bool) or not peer_timeout_s > 0:
            raise ConfigError.option("peer_timeout_s", f"{{opt}} must be a positive number of seconds, got "
                                                       f"{peer_timeout_s!r}")
        self.peer_timeout_s = float(peer_timeout_s)
        self._skips = skip.Skipper(skip.SkipSettings(
            on_failure=on_failure, skip_budget_s=skip_budget_s, max_skips=max_skips, skip_window=skip_window,
            skip_indices=skip.as_indices(skip_indices)), Path(out_dir))
        self.on_incident = fail_fast.check_on_incident(on_incident)
        self._incidents: RankIncidents | None = None
        """Under a process group: this rank's part in its incidents (see :mod:`reprokit.distributed.rank_incidents`)."""
        importing = importing_for_replay()
        if importing:  # a CodeLoadError: replay's import passes it on as it is, without its generic advice
            raise CodeLoadError(f"a Recorder was created while replay imported {importing} for build() and the "
                               "step function: the file trains when it is imported, so every replay would run "
                               "your whole training again. Put the training loop under "
                               "`if __name__ == \"__main__\":`, then record the bundle again.")
        self.budget = default_host_budget() if host_memory_budget is None else int(host_memory_budget)
        if self.budget <= 0:
            raise ConfigError(f"host_memory_budget must be a positive number of bytes, got {host_memory_budget}")
        self.state = state
        self.train_step = train_step
        self.out_dir = Path(out_dir)
        self.snapshot_every = snapshot_every
        self.settings = DetectSettings(check_grads=check_grads, check_params=check_params,
                                       scaler_patience=scaler_patience, spike_factor=spike_factor,
                                       spike_window=spike_window)
        build_ref, build_root = ref_of(build, "build")
        step_ref, step_root = ref_of(train_step, "train_step")
        self._root = build_root or step_root
        self._refs: dict[str, Any] = {"build": build_ref, "step": step_ref,
                                      "predicates": [self._predicate_ref(fn) for fn in detect]}
        self._scripts = [self._root / r["script"] for r in (build_ref, step_ref) if "script" in r and self._root]
        self._carry(carry)
        config_tree, config_tensors = pytree.encode(config, "config")
        if config_tensors:
            raise CaptureError(f"config holds tensors ({', '.join(config_tensors)}); pass plain data that build() "
                               "turns into tensors")
        self._config = config_tree
        capture_state(state, copy=lambda t: t)  # fail now, at attach time, if anything cannot be recorded
        check_generators(state.extra)
        self._history: deque[list[Any]] = deque(maxlen=loss_history)
        """[step, loss, grad norm, LR, loss scale] per step; loss, norm and scale are filled in once judged."""
        self._board: IncidentBoard | None = None
        self._flight: FlightLog | None = None
        self._flight_later: tuple[int, int, _Step] | None = None
        """(step, position, record) of a step whose CUDA batch the flight log writes once its copy has landed."""
        self.durable = bool(durable)
        if self.durable and replicated_state is True:
            raise ConfigError("durable=True records every rank's own state (a flight log must replay alone after its "
                              "process died); pass replicated_state=\"auto\" or False with it")
        if self.durable:
            replicated_state = False
        self.monitor = Monitor(state, self.settings, detect, max_lag=max_lag)  # from here on, hooks are on the optimizer
        try:
            self._set_up(state, detect, spill_dir, snapshot_sync, incident_wait_s, replicated_state)
        except BaseException:
            self._refused()  # a refused Recorder leaves nothing on the user's optimizer (or watching the out_dir)
            raise

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc is None:
            self.close()
            return
        if device_error.is_sticky(exc):
            self.report_device_error(exc)  # surfaced outside step(): the bundle is written from host memory
        try:
            self.close()
        except TrainingFailure as seen:  # the block's own exception stays the one raised; it says what was seen too
            _add_note(exc, f"reprokit: when the Recorder closed, {seen}")

    def _set_up(self, state: TrainState, detect: Sequence[Predicate], spill_dir: str | Path | None,
                snapshot_sync: bool, incident_wait_s: float, replicated_state: str | bool) -> None:
        """The part of ``__init__`` that runs once the monitor's hooks are on the optimizer (see :meth:`_refused`)."""
        self._tables = model_tables(state.model)  # table sizes for the batch diagnosis (inspect, failure note)
        self._engine = SnapshotEngine(state, spill_dir, sync=snapshot_sync, limit=self.budget * 3 // 4,
                                      fallback_spill_dir=self.out_dir / SPILL_DIR)
        self._model_device = next((p.device for p in state.model.parameters() if p.is_cuda), None)
        self._engine.others = self._room_for_snapshot
        self._pool = BatchPool()
        """The host buffers each step's batch is copied into (see :mod:`reprokit.batch_pool`)."""
        self._marks: dict[torch.device, device_error.HostMarker] = {}
        """Per CUDA device: the last step whose start (its batch copies, and everything queued before them on the
        training stream) has run, in pinned host memory (see :mod:`reprokit.device_error`)."""
        self._landed: dict[torch.device, torch.cuda.Event] = {}
        """Durable recording only: recorded on the training stream after the last step's batch copies."""
        self._warned: set[str] = set()
        # After the markers' dict and the warnings' set, which it fills (an AttributeError here once made every GPU
        # run's host-made CUDA RNG count as unchecked: see _read_devices).
        self._device_names, self._host_rng_why = self._read_devices()
        self._host_rng = self._host_rng_why is None
        self._kept: _Kept | None = None
        self._dead: str | None = None
        """The sticky device error after which the recorder touches the GPU no more."""
        self._dead_bundle: Path | None = None
        self.dead_write_seconds: float | None = None
        """Seconds the bundle took to write after a sticky device error (from the failure to the bundle on disk)."""
        self._late_reported = False
        """Whether :meth:`report_device_error` has tried to write a bundle (once per recorder)."""
        self._closed = False
        self._ring_other = 0
        """Bytes the window holds outside the pool: RNG states, numpy leaves of batches."""
        self._mem = {"peak_pinned_bytes": 0, "peak_pageable_bytes": 0, "early_snapshots": 0, "unrecorded_steps": 0}
        self._postponed = 0
        """Steps the due snapshot has been postponed by, waiting for earlier steps' checks (see _checks_settled)."""
        self._postponed_total = 0
        self._opt_entries = -1  # len(optimizer.state) when buffers were last pinned aside for it
        self.step_index = 0
        self.bundles: list[Path] = []
        self._snapshot: _Snapshot | None = None
        self._ring: list[_Step] = []
        self._window_ok = False
        self._open: tuple[Any, _Step | None] | None = None
        """The batch and record of the step :meth:`begin_step` opened, until :meth:`end_step`."""
        self._resnap = False  # take a snapshot at the next synced step (see reprokit.state.accumulation_phase)
        self._in_step = False
        self._current_other = RNG_STEP_BYTES
        self._mention_leftovers()
        self._probe_out_dir()
        self.incident_wait_s = incident_wait_s
        self.rank = rank_info(self.out_dir)  # under a process group: rank 0's Recorder names the run (store)
        if self.rank is not None and self.rank.rank != 0 and not sees_rank0(self.out_dir, self.rank):
            self._warn("", f"reprokit: rank {self.rank.rank} records into {self.out_dir}, where rank 0's mark of this "
                           "run is not (a per-rank out_dir, a disk of this node only, or one rank 0 cannot write): "
                           "a failure on one rank will not make the others write their windows, and a rank blocked "
                           "in a collective writes none. Give every rank the same out_dir on a filesystem they all "
                           "see.")
        if self.rank is not None and self.rank.rank == 0 and nccl_aborts_on_device_errors(self.rank.backend):
            self._warn("nccl-rethrow", "reprokit: under NCCL, a device error on a rank (a device-side assert, an illegal "
                       "memory access) makes NCCL's watchdog thread abort that process within a fraction of a second, "
                       "before reprokit can write its bundle, and torchrun then stops the other ranks. Set "
                       "TORCH_NCCL_RETHROW_CUDA_ERRORS=0 in the job's environment (NCCL reads it when the process "
                       "group is created): the error then reaches the loop as an exception and every rank writes its "
                       "window. With durable=True the window is on disk either way: `reprokit recover OUT_DIR`.")
        self._lock: Any = contextlib.nullcontext()
        if self.rank is not None:
            self._lock = threading.RLock()  # the incident watcher writes the window from another thread
            self._board = IncidentBoard(self.out_dir, self.rank)
            self._board.attach()
            self._incidents = RankIncidents(self, self._board, self.rank)
        # This rank references the owner's state instead of snapshotting its own (a non-owner, replicated).
        self._refer = self._replication(replicated_state)
        self._saved = 0
        """Bytes of state this rank did not copy at its last snapshot step (rank 0's are referenced instead)."""
        if not self._refer:
            try:  # pinning host memory at step 0 would cost the first window several percent on a GPU
                self._engine.pin_ahead()
            except Exception as e:  # never a reason to refuse the run: the first snapshot pins what it needs
                self._warn("pin", f"reprokit: could not pin snapshot buffers ahead ({e!r}); the first snapshot will")
        try:
            self.monitor.warm_up()
        except Exception as e:  # the first step then loads the kernels itself
            self._warn("warm", f"reprokit: could not warm up the step checks ({e!r}); the first step will")
        if self.durable:
            self._start_flight()
        if self._board is not None and self._incidents is not None:
            inc = self._incidents
            self._board.watch(inc.on_incident, tick=inc.watch_peers if inc.peers is not None else None)
        if self._model_device is not None:
            late_device_errors.watch(self)  # a device error that surfaces outside step() still writes the bundle

    def _start_flight(self) -> None:
        """Open the flight log (``durable=True``): what a bundle needs that does not change is written now."""
        code = [] if self._root is None else [(relative(p, self._root), p)
                                              for p in snapshot_files(self._root, self._scripts)]
        run = self._run_base()
        owner = {"rank": None, "world_size": None, "out_dir": str(self.out_dir.absolute())}
        if self.rank is not None:
            run["distributed"] = {**self.rank.to_json(), "incident": None}
            owner.update(self.rank.to_json(), run_key=self.rank.run_key)
        try:
            env = capture_env(self._root)
        except Exception as e:
            self._warn("", f"reprokit: durable recording is off: cannot read the environment ({e!r})")
            return
        self._flight = FlightLog.start(self.out_dir, flight_run_id(self.rank.run_key if self.rank else None),
                                       self.rank.rank if self.rank else None, owner, run, env, code,
                                       lambda message: self._warn("flight", message))
        if self._flight is not None:
            self._flight.in_step = lambda: self._in_step
            if self._incidents is not None and self.rank is not None and self.rank.world_size > 1:
                self._incidents.peers = PeerWatch(self._flight.run_folder, self.rank.rank, self.rank.world_size,
                                                  self.peer_timeout_s)

    def _carry(self, objects: Sequence[Any]) -> None:
        """List ``objects`` (the ``carry`` option) under ``refs.objects`` and put their files in the code snapshot.

        Raises:
            CaptureError: an object replay could not import by name, or a project file that cannot be read (said
                now, at attach time, not when a bundle is written).
        """
        refs = self._refs.setdefault("objects", [])
        for obj in objects:
            ref, root = ref_of(obj, "carry")
            if root is None:
                continue  # installed code: replay imports the installed version, which the environment records
            if ref not in refs:
                refs.append(ref)
            if self._root is None:
                self._root = root
            if "script" in ref and root / ref["script"] not in self._scripts:
                self._scripts.append(root / ref["script"])
        if objects and self._root is not None:
            snapshot_files(self._root, self._scripts)

    def _refused(self) -> None:
        """Undo what a constructor that raised had attached: the monitor's and the snapshot engine's optimizer hooks,
        the incident watcher. Errors here must not hide the refusal itself."""
        late_device_errors.forget(self)
        engine = getattr(self, "_engine", None)
        flight = getattr(self, "_flight", None)
        for undo in (getattr(self._board, "close", None), self.monitor.close, getattr(engine, "close", None),
                     getattr(flight, "close", None)):
            if undo is not None:
                with contextlib.suppress(Exception):
                    undo()

    def _replication(self, mode: str | bool) -> bool:
        """Whether this rank references rank 0's state (see ``replicated_state``)."""
        if mode not in ("auto", True, False):
            raise ConfigError(f"replicated_state must be \"auto\", True or False, got {mode!r}")
        layout = replicated.is_replicated_layout(self.state.model, self.state.extra)
        if mode is True and (self.rank is None or self.rank.world_size < 2 or not layout):
            raise ConfigError("replicated_state=True needs an initialised process group of two or more ranks and "
                               "a state that is the same on every rank (a DistributedDataParallel model, no DTensor "
                               "parameters, nothing but generators in state.extra); pass replicated_state=\"auto\" or False")
        on = mode is True or (mode == "auto" and self.rank is not None and self.rank.world_size > 1 and layout)
        self._owns = on and self.rank is not None and self.rank.rank == replicated.OWNER_RANK
        """This rank snapshots the state the others reference."""
        return on and self.rank is not None and self.rank.rank != replicated.OWNER_RANK

    def _probe_out_dir(self) -> None:
        """Say at attach, not at the failure hours later, when ``out_dir`` cannot be written (a read-only mount, a
        file in the way). Nothing is created: an existing ``out_dir`` is probed with a temporary file, else the
        nearest folder above it that exists."""
        folder, why = write_probe(self.out_dir)
        if why is not None:
            self._warn("out_dir", f"reprokit: cannot write into {folder} ({why}), so a failure would give no bundle "
                                  f"in out_dir={str(self.out_dir)!r}. Training goes on; give the Recorder an out_dir "
                                  "it can write to.")

    def _mention_leftovers(self) -> None:
        """Say, once at attach, when ``out_dir`` holds temp folders that killed writers left behind."""
        try:
            left = [x for x in find_leftovers(self.out_dir) if x.removable]
        except Exception:
            return  # never let a look around the output folder stop the run
        if left:
            size = sum(x.bytes for x in left)
            warnings.warn(f"reprokit: {self.out_dir} holds {len(left)} unfinished bundle folder(s) ({mib(size)}) "
                          f"left by writers that were killed; `reprokit gc {self.out_dir}` removes them",
                          RecorderWarning, stacklevel=3)

    # --- the hot path -----------------------------------------------------------

    def step(self, batch: Any) -> Any:
        """Run ``train_step(state, batch)`` under watch and return its loss.

        A loss tensor comes back detached from its autograd graph (backward has run; the
        graph is freed while the device finishes the step rather than after the loss read).

        Raises:
            Exception: the step's own exception, unchanged (a note names the bundle).
            TrainingFailure: when a detector fires; ``.bundle`` is the bundle path. Checks are judged once their
                values reach the host (see ``max_lag``), so it may be an earlier step's failure:
                ``.failure.step`` is the step that failed, ``.detected_lag`` how many steps later it was seen (and
                when it is seen before this step starts, this step's batch is not run).
        """
        batch = self._skips.filter(batch, self.step_index)
        record = self._begin_step(batch)
        result = self.monitor.run(self.train_step, batch, self.step_index, after=self._locked_after_step)
        if result.exc is not None and self._incidents is not None and self._incidents.peers is not None:
            self._incidents.await_dead_peer(result.exc)
        return self._finish_step(batch, record, result)

    # --- a step driven by a framework ---------------------------------------------------

    def begin_step(self, batch: Any) -> None:
        """Start a step whose work the caller runs itself: what :meth:`step` does before it calls ``train_step``.

        For a framework that owns its loop (the Hugging Face Trainer, Lightning, your own trainer): call this with
        the step's batch (everything ``train_step`` will be given on replay) before the step's first forward, run
        the step, then call :meth:`end_step`. The batch is copied, the random generators are read and, when one is
        due, the snapshot is taken here. Replay runs the bundle's ``train_step`` on the recorded batch, so that
        function must do what the framework did (see the docs' "Writing an integration" page).

        Raises:
            PeerFailure: a peer rank failed and this rank's part of the run was ended (``on_incident="abort"``).
            ConfigError: a step is already open (:meth:`end_step` was not called for it).
        """
        if self._open is not None:
            raise ConfigError(f"begin_step() called while step {self.step_index} is open: call end_step() first")
        record = self._begin_step(batch)
        self._open = (batch, record)
        self.monitor.begin()

    def end_step(self, loss: Any = None, exc: BaseException | None = None) -> Any:
        """End the step :meth:`begin_step` opened: run the detectors on ``loss`` (and the gradients the optimizer's
        hooks checked), and on a failure write the bundle and raise.

        Args:
            loss: the step's loss (a tensor or a number; ``None`` when the framework gives none).
            exc: the exception that stopped the step, if one did: it is recorded and re-raised unchanged.

        Returns:
            ``loss`` (a tensor comes back detached), as :meth:`step` returns it.

        Raises:
            Exception: ``exc`` itself, with a note that names the bundle (never skipped under
                ``on_failure="skip"``: it has left the framework's loop; only :meth:`step` can skip an exception).
            TrainingFailure: when a detector fired (unless ``on_failure="skip"`` proved and skipped its rows);
                ``.bundle`` is the bundle path.
            ConfigError: no step is open.
        """
        if self._open is None:
            raise ConfigError("end_step() called with no step open: call begin_step(batch) first")
        batch, record = self._open
        self._open = None
        self._locked_after_step()
        result = self.monitor.conclude(self.step_index, loss, exc)
        if result.exc is not None and self._incidents is not None and self._incidents.peers is not None:
            self._incidents.await_dead_peer(result.exc)
        # on_failure="skip" never skips an exception handed in here: it has already left the framework's loop.
        self._skips.exceptions_end_the_loop = skip.CAUGHT_BY_THE_CALLER if exc is not None else None
        try:
            return self._finish_step(batch, record, result)
        finally:
            self._skips.exceptions_end_the_loop = None

    def without_skipped(self, batch: Any) -> Any:
        """``batch`` without its rows whose dataset index is in ``skip_indices`` (``batch`` itself when there are
        none, or no ``skip_indices``): what :meth:`step` trains on. A framework that owns its loop trains on what
        this returns and hands that to :meth:`begin_step`, so that the recorded batch is the one trained on."""
        return self._skips.filter(batch, self.step_index)

    def skip_step(self, message: str) -> None:
        """Count a step that cannot be recorded (a framework's step that ``train_step`` could not replay): the
        step index moves on as the framework's does, and the window is dropped, so no bundle is written until the
        next snapshot. ``message`` is warned once."""
        self._drop_window("skip", message)
        self.step_index += 1

    @property
    def in_step(self) -> bool:
        """Whether a step is running: between :meth:`begin_step` and :meth:`end_step`, or inside :meth:`step`."""
        return self._in_step

    def request_snapshot(self) -> None:
        """Take a snapshot at the next step that can start a window (under gradient accumulation, the next
        update's first micro-batch). For state changes ``train_step`` cannot replay: a learning rate changed outside
        the step (a scheduler stepped on an epoch boundary, a manual ``param_group["lr"] = ...``), a resumed
        checkpoint, a model edited between steps. The window restarts from the state as it is then."""
        self._resnap = True

    def _begin_step(self, batch: Any) -> _Step | None:
        """Step start: copy the batch, read the RNG, snapshot when due."""
        k = self.step_index
        inc = self._incidents
        if inc is not None and inc.aborted is not None:  # a peer failed and this rank's part of the run was ended
            raise inc.peer_failure(inc.aborted)
        if self._in_step:  # the last step was interrupted (Ctrl-C): its partial updates are not replayable
            self._flight_later = None
            self._drop_window("interrupted", f"reprokit: step {k - 1} was interrupted; no bundle until the next "
                                             f"snapshot (step {self._next_snapshot(k)}).")
        self._in_step = True
        with self._lock:
            return self._record_step_start(k, batch)

    def _finish_step(self, batch: Any, record: _Step | None, result: StepResult) -> Any:
        """The step is over (``result``): count it, and on a failure write the bundle and raise."""
        k = self.step_index
        # A peer failed and this rank's window is written (on_incident="abort"): an error now is its collective breaking.
        inc = self._incidents
        peer_error = inc is not None and inc.peer_doc is not None and result.exc is not None and \
            self.on_incident == "abort"
        if result.failure is not None and not peer_error and inc is not None:
            inc.failed_at = k  # before the step is over: the incident watcher reads it then (_end_after_incident)
        self.step_index += 1
        self._in_step = False
        try:
            self._engine.check()
        except Exception as e:  # a device error; the step's own outcome below is what the user sees
            self._engine.broken = True
            self._warn("check", f"reprokit: cannot check the snapshot copy ({e!r}); no bundle until the next snapshot")
        if self._flight is not None and record is not None:
            self._flight.record(b"end ", {"step": k, "loss": _plain(result.loss), "grad_norm": _plain(result.grad_norm),
                                          "failed": result.failure is not None})
        self._history.append([k, None, None, *_lr_and_scale(self.state)])
        self._note_checked(result)
        if result.failure is None:
            if inc is not None:
                inc.stepped_since = True
            return result.value
        if peer_error and inc is not None and inc.peer_doc is not None:
            raise inc.peer_failure(inc.peer_doc) from result.exc
        if result.failure.step == k:
            return self._fail(batch, record, result)
        return self._fail(None, self._recorded_step(result.failure.step), result)

    def _note_checked(self, result: StepResult) -> None:
        """Steps whose checks were judged: their loss and grad norm go into the window's records and the history."""
        scaled = self.state.scaler_enabled()
        for c in result.checked:
            for r in reversed(self._ring):
                if r.step <= c.step:
                    if r.step == c.step:
                        r.loss, r.grad_norm = c.loss, c.grad_norm
                    break
            for h in reversed(self._history):
                if h[0] <= c.step:
                    if h[0] == c.step:
                        h[1], h[2] = c.loss, c.grad_norm
                        if h[4] is None and scaled:
                            h[4] = c.scale
                    break

    def _fail(self, batch: Any, record: _Step | None, result: StepResult) -> Any:
        """Write the bundle of ``result``'s failure, then skip its proven culprit rows (``on_failure="skip"``: the
        value the step returns) or raise it. ``batch``: the failing step's own when it is the step that just ran
        (None: the window's copy of it, ``record``, is read for the note)."""
        assert result.failure is not None
        inc = self._incidents
        path = self._dump(result.failure, lag=result.lag) if inc is None else inc.dump(result.failure, lag=result.lag)
        attempt = self._skips.after_failure(self, result.failure, record, path, lag=result.lag) \
            if self._skips.on else None
        if attempt is None:
            self._skips.decline(self, result.failure)
        if attempt is not None and attempt.skipped:
            return attempt.value  # the proven culprit rows are skipped: the run goes on (see reprokit.skip)
        hint = failure_note(self._note_batch(batch, record), self._tables)
        why_not = attempt.note if attempt is not None else None
        # What to run next: one process's bundle, or under a process group the incident folder it is in (every rank
        # replayed together) and this rank's bundle alone.
        q = shlex.quote(str(path)) if path else ""
        if not path:
            nxt = None
        elif self._board is None:
            nxt = (f"reprokit: next: `reprokit replay {q} --times 3` (exit 1 while it fails), `reprokit inspect {q}`, "
                   f"`reprokit shrink {q} -o small`")
        else:
            nxt = (f"reprokit: next: `reprokit replay {shlex.quote(str(path.parent))}` (every rank of the incident, "
                   f"exit 1 while it fails), `reprokit replay {q}` (this rank alone), `reprokit inspect {q}`")
        if result.exc is not None:
            note = f"reprokit: bundle written to {path}" if path else "reprokit: no bundle could be written"
            for line in (hint, why_not, note, nxt):
                if line:
                    _add_note(result.exc, line)
            raise result.exc
        failure = TrainingFailure(result.failure, path, lag=result.lag)
        for line in (hint, why_not, nxt):
            if line:
                _add_note(failure, line)
        raise failure from result.later

    def _recorded_step(self, step: int) -> _Step | None:
        """The window's record of step ``step`` (a failure seen steps after it ran), or None."""
        for r in self._ring:
            if r.step == step:
                return r
        return None

    def wait_for_checks(self) -> None:
        """Judge every step's checks now, waiting for the device (one host wait), and raise as :meth:`step` does.

        ``rec.step`` judges a step's checks once their values have reached the host, up to ``max_lag`` steps later.
        Call this where the loop waits for the device anyway (an evaluation, a checkpoint, the end of an epoch) to
        know now; :meth:`close` calls it.

        Raises:
            TrainingFailure: a step's check fired (``.bundle`` is its bundle; the message says which step and how many
                steps later it was seen).
            Exception: a step's own exception is raised by the step call, never here.
        """
        self.monitor.settle(self.step_index - 1, wait=True)
        if self.monitor.noticed is None:
            self._note_checked(self.monitor.collect())
            return
        result = self.monitor.collect()
        assert result.failure is not None
        self._note_checked(result)
        if self._incidents is not None:
            self._incidents.failed_at = self.step_index - 1
        self._fail(None, self._recorded_step(result.failure.step), result)

    def _record_step_start(self, k: int, batch: Any) -> _Step | None:
        """Copy the batch and read the RNG; take the snapshot when one is due (after the batch copy is queued, so on
        a GPU the batch's small copy does not wait behind the state's). On a GPU, a marker follows the batch copies
        on the training stream (see :meth:`_mark_start`). Once the device died, nothing (no CUDA call)."""
        if self._dead is not None:
            return None
        self._pool.copied.clear()
        if self._kept is not None and self._snapshot is not None and self._engine.complete(self._snapshot.serial):
            self._kept = None  # the snapshot that replaced it has landed (read from host memory)
        try:
            rec = self._capture_step_start(k, batch)  # raises only a sticky error (it says its own faults)
            self._mark_start(k)
        except Exception as e:
            if device_error.is_sticky(e):  # a CUDA call of the batch copy, the snapshot or the marker: the device died
                self._device_died(e)
                return None
            # The marker (the capture says its own faults): a device error would then give no bundle.
            self._drop_window("mark", f"reprokit: cannot mark step {k} ({e!r}); no bundle until the next snapshot "
                                      f"(step {self._next_snapshot(k)}). Training continues.")
            return None
        return rec

    def _capture_step_start(self, k: int, batch: Any) -> _Step | None:
        try:
            torn = self._engine.torn
            boundary, last_batch, n = accumulation_phase(self.state.optimizer)
            if torn:
                when = f"step {k}" if boundary else "the next step that starts an update (accelerate accumulates)"
                self._drop_window("torn", f"reprokit: the snapshot at step {self._snapshot.step if self._snapshot else k}"
                                          f" is not the state that step started from ({torn}); a new one is taken at "
                                          f"{when}, with those tensors copied in stream order from now on.")
            due = bool(torn) or self._snapshot is None or k - self._snapshot.step >= self.snapshot_every or \
                self._resnap
            if due and not boundary:
                # Mid-accumulation under accelerate: the snapshot (a torn one's replacement too) waits for the next
                # synced step, where replay's fresh Accelerator starts counting as the run did.
                due = False
            postponed = due and not self._checks_settled(k)
            if self.monitor.noticed is not None:  # an earlier step's check fired: its window is kept, this step not run
                self._engine.discard_prepared()
                return None
            due = due and not postponed
            # A dataloader's last batch syncs early, which replay would not: the window restarts after it.
            self._resnap = last_batch or (self._resnap and not due)
            if last_batch:
                # accelerate syncs here because the dataloader ends; replay, fed from the bundle, syncs only where its
                # fresh counter (0 at the window's start) reaches the accumulation: else this step cannot replay.
                at = 1 if due or self._snapshot is None else k - self._snapshot.step + 1
                if at % n:
                    self._engine.discard_prepared()
                    self._drop_window("last_batch", f"reprokit: step {k} is a dataloader's last batch, where "
                                                    f"accelerate steps the optimizer early (after {at} of {n} "
                                                    "accumulated batches); replay, fed from the bundle, would not, so "
                                                    f"no bundle for it; the next window starts at step {k + 1}.")
                    return None
            if not due and not postponed:
                self._engine.discard_prepared()  # prepared for a snapshot that is not taken now: stale later
            if not due and not self._window_ok:
                return None
            rng = capture_rng(self.state.extra)  # before anything can draw: the state this step starts from
            batch_bytes, other = _batch_bytes(batch)
            other += RNG_STEP_BYTES * (1 + len(rng.owned))
            need = batch_bytes + other
            position = 0 if due else k - self._snapshot.step  # type: ignore[union-attr]
            if not self._fits(k, position, need):
                if not self._checks_settled(k, wait=True):  # the window ends here: every earlier step judged first
                    self._engine.discard_prepared()
                    return None
                if self._refer and not due and position > 0:
                    self._leave_replication(k, "its window reached the host-memory budget")
                if not due and not boundary:
                    # An early snapshot here would start mid-accumulation, where replay's fresh Accelerator syncs
                    # elsewhere: the window ends, and the next synced step starts a new one.
                    self._engine.discard_prepared()
                    self._skip(k, need, due)
                    self._resnap = True
                    return None
                if due or position == 0 or not self._fits(k, 0, need, early=True):
                    self._engine.discard_prepared()
                    self._skip(k, need, due)
                    return None
                due, position = True, 0
            if self._flight is not None:
                self._flight.reserve(position)  # the record one window ago that reads these buffers is written
            if due:
                self._keep_window()
            self._pool.start(position, kept_steps=len(self._kept.ring) if self._kept is not None else 0)
            tree, tensors = self._pool.encode(batch)
            later = bool(self._pool.copied)
            rec = _Step(k, tree, tensors, rng, other)
            if due:
                self._current_other = rec.other_bytes  # this step's own bytes count against the snapshot's room
                self._take_snapshot(k)
            self._ring.append(rec)
            if self._flight is not None and self._window_ok:
                if later:  # a CUDA batch: on the host once the step's copies land (see _after_step)
                    self._flight.record(b"begn", {"step": k})
                    self._flight_later = (k, position, rec)
                else:
                    self._flight.step(k, tree, tensors, rng)
            self._ring_other += rec.other_bytes
            self._note_peak()
            return rec
        except Exception as e:
            if device_error.is_sticky(e):
                raise  # the device died: the window stays as it is (see _record_step_start)
            self._drop_window("capture", f"reprokit: cannot record step {k} ({e}); no bundle can be written until "
                                         f"the next snapshot (step {self._next_snapshot(k)}). Training continues.")
            return None

    def _free_spares(self) -> None:
        """Drop the kept window and free the spare batch buffers it made necessary."""
        self._kept = None
        self._pool.free_spares()

    def _keep_window(self) -> None:
        """A snapshot is about to be taken: keep the window it replaces while the new one copies (see :class:`_Kept`),
        where the engine leaves the last snapshot's buffers intact through a take (two sets, ``keep_previous``)."""
        self._kept = None
        snap = self._snapshot
        engine = self._engine
        if self._window_ok and snap is not None and self._ring and not snap.referenced and \
                isinstance(snap.tensors, dict) and engine.keeps_last and not engine.sync and engine.spill_dir is None:
            self._kept = _Kept(snap, list(self._ring), self._ring_other)

    def _mark_start(self, k: int) -> None:
        """After step ``k``'s batch copies, on each device's training stream: the marker of step ``k`` (on the model's
        device too, whatever the batch: it tells which step a device error struck in)."""
        devices = set(self._pool.copied)
        if self._model_device is not None:
            devices.add(self._model_device)
        for device in devices:
            mark = self._marks.get(device)
            if mark is None:
                mark = self._marks[device] = device_error.HostMarker(device)
            mark.mark(k)
        if self._flight is not None and self._pool.copied:
            for device in self._pool.copied:
                event = self._landed.get(device)
                if event is None:
                    event = self._landed[device] = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))

    def _after_step(self) -> None:
        """The step function has just returned (or raised); the device is still working through it.

        A durable log gets this step's GPU batch once its copies land (on its writer thread); when the next step
        takes a snapshot, the state is walked for it now (see :meth:`SnapshotEngine.prepare`).
        """
        if self._dead is not None:
            return
        later, self._flight_later = self._flight_later, None
        if later is not None and self._flight is not None:
            k, position, rec = later
            self._flight.step_later(k, position, rec.batch, rec.tensors, rec.rng,
                                    [self._landed[d] for d in self._pool.copied if d in self._landed])
        if len(self.state.optimizer.state) != self._opt_entries and not self._refer:
            # Optimizer state appeared (AdamW's moments, after the first step): pin its snapshot buffers on a helper
            # thread now, snapshot_every steps before the next snapshot needs them.
            try:
                if self._engine.pin_aside():  # else a thread still pins: ask again after the next step
                    self._opt_entries = len(self.state.optimizer.state)
                    self._note_peak()  # what it pins counts from now
            except Exception as e:
                self._opt_entries = len(self.state.optimizer.state)
                self._warn("pin", f"reprokit: could not pin snapshot buffers aside ({e!r}); the next snapshot will")
        snap = self._snapshot
        # While the snapshot is postponed (_checks_settled), walk the state again only for the step that will wait.
        if snap is not None and self.step_index + 1 - snap.step >= self.snapshot_every and not self._refer and \
                self._postponed in (0, self.monitor.checks.max_lag):
            self._engine.prepare()

    # --- the host-memory budget ------------------------------------------------------

    def held_bytes(self) -> int:
        """Host memory the recorder holds now: snapshot, batch-buffer pool, the window's RNG states (and the kept
        window's, while its successor's snapshot copies)."""
        kept = self._kept.other if self._kept is not None else 0
        return self._engine.held_bytes + self._pool.bytes() + self._ring_other + kept

    def _fits(self, k: int, position: int, need: int, early: bool = False) -> bool:
        """Whether step ``k``'s ``need`` bytes fit the budget at ``position`` of the window, after freeing buffers the
        window does not use. ``early``: the window would restart here (an early snapshot; said once)."""
        if self._projected(position, need) <= self.budget:
            fits = True
        else:
            self._pool.free_after(position)
            self._free_spares()
            fits = self._projected(position, need) <= self.budget
        if fits and early:
            self._mem["early_snapshots"] += 1
            if self._owns and self._board is not None and self._mem["early_snapshots"] == 1:
                replicated.mark_owner_early(self._board.path, k)  # the other ranks take their own snapshots
            window = self.held_bytes() - self._engine.held_bytes
            steps = k - self._snapshot.step if self._snapshot else 0
            self._warn("early", f"reprokit: the window reached the host-memory budget ({mib(self.budget)}: snapshot "
                                f"{mib(self._engine.held_bytes)}, window {mib(window)}) after {steps}"
                                f" steps, fewer than snapshot_every={self.snapshot_every}; snapshots are taken early "
                                "from now on, so bundles hold fewer steps (host_memory_budget= raises it).")
        return fits

    def _skip(self, k: int, need: int, due: bool) -> None:
        """Step ``k`` cannot be recorded within the budget: no window until the next snapshot (said once)."""
        self._mem["unrecorded_steps"] += 1
        if due:
            self._snapshot = None  # retried at the next step
        self._drop_window("budget", f"reprokit: step {k}'s batch ({mib(need)}) and the snapshot "
                                    f"({mib(self._engine.held_bytes)}) do not fit the host-memory budget "
                                    f"({mib(self.budget)}); steps that do not fit are not recorded, so no bundle "
                                    "until the next snapshot. Raise host_memory_budget= to record them.")

    def _projected(self, position: int, need: int) -> int:
        """Held bytes once a step of ``need`` bytes sits at ``position`` (the buffers there reused or replaced);
        at position 0 the window restarts, so its RNG states are dropped."""
        window_other = self._ring_other if position > 0 else 0
        return self._engine.held_bytes + self._pool.bytes() - self._pool.bytes_at(position) + window_other + need

    def _room_for_snapshot(self, make_room: bool) -> int:
        """Bytes the budget leaves for a snapshot being taken now: the window restarts with this step (position 0),
        so buffers of later positions are unused and, with ``make_room``, freed."""
        if make_room:
            self._pool.free_after(0)
            self._free_spares()  # the budget first: a window kept for a device error is a nicety
        return self.budget - self._pool.bytes() - self._current_other

    def _note_peak(self) -> None:
        e = self._engine.stats
        self._mem["peak_pinned_bytes"] = max(self._mem["peak_pinned_bytes"], e["pinned_bytes"] + self._pool.pinned)
        self._mem["peak_pageable_bytes"] = max(self._mem["peak_pageable_bytes"],
                                               e["pageable_bytes"] + self._pool.pageable + self._ring_other)

    def stats(self) -> dict[str, Any]:
        """Host memory of the recorder and what the budget did.

        Returns:
            ``budget_bytes``; ``held_bytes`` now; ``peak_pinned_bytes`` and ``peak_pageable_bytes``
            (the snapshot, the batch-buffer pool and the window's RNG states); ``snapshot_bytes``;
            ``window_steps`` and ``window_bytes`` (batches and RNG of the current window);
            ``early_snapshots`` (taken before ``snapshot_every`` to stay in the budget);
            ``unrecorded_steps``; ``snapshots_spilled`` (why snapshots go to disk, or None); ``state``:
            ``"snapshotted"``, or ``"referenced"`` on a rank whose bundles reference rank 0's state
            (``replicated_state``), with ``state_bytes_saved``, the state bytes it did not copy.
            Detection lag (see ``max_lag``): ``max_lag``; ``lag_max`` and ``lag_mean``, the steps that ran after
            a step before its checks were judged; ``lag_waits``, how many times the recorder waited for the device
            to judge one (a check ``max_lag`` steps old, a postponed snapshot, :meth:`wait_for_checks`);
            ``snapshot_postponed_steps``, the steps snapshots were postponed by in all; ``checks_pending`` now.

        Example:
            >>> rec.stats()["peak_pinned_bytes"]                             # doctest: +SKIP
            1598029824
        """
        window = self._pool.window_bytes(len(self._ring))
        return {"budget_bytes": self.budget, "held_bytes": self.held_bytes(), **self._mem,
                "snapshot_bytes": self._engine.held_bytes, "window_steps": len(self._ring),
                "window_bytes": window + self._ring_other, "snapshots_spilled": self._engine.spilled_for_memory,
                "state": "referenced" if self._refer else "snapshotted", "state_bytes_saved": self._saved,
                **self.monitor.checks.stats(), "snapshot_postponed_steps": self._postponed_total}

    def _drop_window(self, key: str, message: str) -> None:
        """The window cannot be replayed any more: forget it until the next snapshot, and say so (once per key)."""
        if self._flight is not None and self._window_ok:
            self._flight.record(b"drop", {"step": self.step_index, "why": key})
        self._window_ok = False
        self._ring.clear()
        self._ring_other = 0
        self._kept = None
        self._warn(key, message)

    def _take_snapshot(self, k: int) -> None:
        self._ring.clear()
        self._ring_other = 0
        self._snapshot = None  # free the old one before copying the new one
        self._window_ok = False
        extra = {"monitor": self.monitor.state_dict(), "step": k}
        if self._refer and any(p.grad is not None for p in self.state.model.parameters()):
            self._leave_replication(k, "gradients are not empty at a snapshot step (they differ per rank)")
        if self._refer and self._board is not None and replicated.owner_went_early(self._board.path):
            self._leave_replication(k, f"rank {replicated.OWNER_RANK} takes early snapshots (its host-memory budget), "
                                       "so its snapshots no longer fall on this rank's")
        if self._refer:  # rank 0 snapshots the state; this rank keeps its own RNG and detector state only
            self._kept = None
            rng_tree, rng_tensors = encode_rng(capture_rng(self.state.extra))
            self._snapshot = _Snapshot(k, {"rng": rng_tree, **extra}, rng_tensors, referenced=True)
            self._saved = sum(t.numel() * t.element_size()
                                                 for t in capture_state(self.state, copy=lambda t: t)[1].values())
            self._window_ok = True
            self._note_peak()
            return
        if self._flight is not None:
            self._flight.settle()  # the engine is about to reuse the host buffers the last snapshot's record reads
        tree, tensors = self._engine.take(extra)
        self._snapshot = _Snapshot(k, tree, tensors, serial=self._engine.serial)
        if not self._engine.previous_kept:
            self._kept = None  # its snapshot's buffers are being written, or the new snapshot is complete already
        self._window_ok = True
        if self._flight is not None:
            cuda = any(t.is_cuda for t in self.state.model.parameters())
            self._flight.new_window(k, tree, tensors, self._engine.copies_landed if cuda else None)
        if self._engine.spilled_for_memory:
            self._warn("spill", f"reprokit: {self._engine.spilled_for_memory}.")
        self._note_peak()

    def _leave_replication(self, k: int, why: str) -> None:
        """From step ``k`` on, this rank snapshots its own state (its bundles stand alone): a window that cannot start
        at rank 0's snapshot must never reference it."""
        self._refer = False
        self._saved = 0
        self._warn("replicated", f"reprokit: rank {self.rank.rank if self.rank else '?'}: {why} at step {k}; this rank "
                                 "takes its own state snapshots from now on (its bundles stand alone and hold the "
                                 "state) instead of referencing rank 0's.")

    def _checks_settled(self, k: int, wait: bool = False) -> bool:
        """Whether a new window may start at step ``k``: every earlier step's check is judged and none fired.

        A snapshot replaces the window, so it is never taken while an earlier step's check is on its way: if that
        step failed, its bundle needs the window that holds it, and the snapshot's detector state (the spike history,
        the GradScaler's skip streak) must count every step before it. While checks are on their way the snapshot
        is postponed by a step rather than waiting for the device: the window grows by one batch of host memory,
        whereas a wait would drain the work the host has queued ahead, the cost lagged checks exist to avoid. After
        ``max_lag`` postponements, or with ``wait`` (the memory budget ends the window), the recorder waits for them:
        at most one host wait per window. Under ``replicated_state`` it waits at once, so that every rank snapshots
        at the same step. A failure found is kept in ``monitor.noticed`` (and the window with it).
        """
        m = self.monitor
        wait = wait or self._postponed >= m.checks.max_lag or self._refer or self._owns
        if m.settle(k - 1, wait=wait):
            self._postponed = 0
            return True
        if m.noticed is None:
            self._postponed += 1
            self._postponed_total += 1
        return False

    def _next_snapshot(self, k: int) -> int:
        start = self._snapshot.step if self._snapshot else k
        return start + self.snapshot_every * ((k - start) // self.snapshot_every + 1)

    # --- on failure ---------------------------------------------------------------

    # --- incidents (several ranks) -----------------------------------------------------

    def _locked_after_step(self) -> None:
        with self._lock:
            self._after_step()

    def _dump(self, failure: Failure, incident: str | None = None, from_watcher: bool = False,
              lag: int = 0) -> Path | None:
        """Write the window as a bundle; on any fault of ours warn and return None. ``lag``: the steps that ran after
        the failing one before it was seen; the window ends at the failing step (the steps after it are not
        replayed).

        After a sticky device error (the failure's kind, or a CUDA call here failing so), the bundle is written from
        host memory alone: see :meth:`_dump_dead`."""
        if failure.kind == FailureKind.DEVICE_ERROR or self._dead is not None:
            return self._dump_dead(failure, incident)
        ring = self._ring
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            try:
                if from_watcher:
                    ring = self._landed_window()  # the main thread may be stuck in a collective: never synchronize
                elif lag:
                    # Steps after the failing one are queued behind it, and under a process group may never finish
                    # (a peer that saw its failure sooner stopped joining collectives): no wait on them. The failing
                    # step's check has landed, so its kernels ran, and with them every batch copy and step marker
                    # queued before them on the training stream (see _mark_start); the markers, read from host
                    # memory, confirm it (a step whose marker has not landed is left out, and the window found
                    # incomplete below).
                    self._engine.wait()
                    last = self._last_marked()
                    ring = [r for r in ring if r.step <= failure.step and (last is None or r.step <= last)]
                else:
                    for device in cuda_devices(self._devices(), torch.cuda.current_device()):
                        torch.cuda.synchronize(device)  # copies in flight must land before we read
                    self._engine.check(ordered=True)
            except Exception as e:
                if device_error.is_sticky(e):  # a later CUDA call failing the same way: the device died in the step
                    self._device_died(e)
                    # The step's exception was a symptom (a library call on the context its kernel had killed):
                    # the bundle's failure is the device error, the exception kept as surfaced_as, as replay says.
                    # The caller's failure becomes that one (as _dump_dead updates the failures it writes in place):
                    # what the run does next (skip, the note) reads the failure the bundle holds.
                    dead = device_error.surfaced_as(failure, e)
                    for field in dataclasses.fields(failure):
                        setattr(failure, field.name, getattr(dead, field.name))
                    return self._dump_dead(failure, incident)
                self._warn("", f"reprokit: {failure.describe()}, but the device failed ({e!r}); no bundle")
                return None
        if not from_watcher:
            ring = [r for r in ring if r.step <= failure.step]
        if not self._window_ok or self._snapshot is None or self._engine.broken or self._engine.torn or not ring or \
                (not from_watcher and ring[-1].step != failure.step):
            self._warn("", f"reprokit: {failure.describe()}, but the recorded window is incomplete; no bundle")
            return None
        return self._write_bundle(failure, self._snapshot, ring, incident, lag=lag)

    def _write_bundle(self, failure: Failure, snap: _Snapshot, ring: list[_Step], incident: str | None,
                      host_only: bool = False, lag: int = 0) -> Path | None:
        """Write ``snap`` and ``ring`` as a bundle of ``failure`` (``host_only``: without a CUDA call; ``lag``: the
        steps that ran after the failing one before it was seen)."""
        writer = None
        try:
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            where = self.out_dir / incident if incident else self.out_dir
            writer = BundleWriter(where, bundle_name(stamp, failure.step, failure.kind,
                                                     self.rank.tag if self.rank is not None else ""))
            path = self._write(writer, failure, ring, incident, snap=snap, host_only=host_only, lag=lag)
        except BaseException as e:  # Ctrl-C while writing must not leave a half-written folder behind either
            if writer is not None:
                writer.abort()
            if not isinstance(e, Exception):
                raise
            # Where it came from (the innermost frame, and the innermost of reprokit's own): a report can say it.
            frames = traceback.extract_tb(e.__traceback__)
            ours = [f for f in frames if f"{os.sep}reprokit{os.sep}" in f.filename]
            where_from = "".join(dict.fromkeys(f" (at {Path(f.filename).name}:{f.lineno} in {f.name})"
                                               for f in [*ours[-1:], *frames[-1:]]))
            self._warn("", f"reprokit: could not write a bundle to {self.out_dir}: {e!r}{where_from}. "
                               "Training's own error is raised as usual.")
            return None
        self.bundles.append(path)
        if self._flight is not None:
            self._flight.record(b"bndl", {"step": failure.step, "path": str(path.absolute()), "incident": incident,
                                          "kind": failure.kind})
        return path

    def _devices(self) -> Iterator[torch.device]:
        """Every device the recorder's copies may be queued on: the state's (model and optimizer), the batch
        tensors' (their copies and markers) and the snapshot engine's stream's."""
        yield from (t.device for t in self.state.model.parameters())
        yield from (t.device for t in self.state.model.buffers())
        for st in self.state.optimizer.state.values():
            yield from (v.device for v in st.values() if isinstance(v, torch.Tensor))
        yield from self._marks
        stream = self._engine.stream
        if stream is not None:
            yield stream.device

    def _landed_window(self) -> list[_Step]:
        """The window as far as its steps' GPU batch copies have landed (a rank blocked in a collective never runs
        what it queued after it); empty when the snapshot copy has not landed either. Host memory only: the
        markers (see :meth:`_mark_start`), no CUDA call from the watcher's thread."""
        if self._snapshot is None or not self._engine.complete(self._snapshot.serial):
            return []
        last = self._last_marked()
        return [r for r in self._ring if last is None or r.step <= last]

    # --- after a sticky device error: host memory only ----------------------------------------

    def _read_devices(self) -> tuple[list[str] | None, str | None]:
        """While the device works (at attach): the GPUs' names for env.json, and why the CUDA generators' state
        cannot be written without a CUDA call (None: it can, see :func:`reprokit.rng.cuda_state_on_host`). Also
        makes the model device's step marker and checks how a GradScaler there can be read without a sync
        (:func:`reprokit.state.check_scaler_layout`, which never raises). Each part on its own: one failing never
        costs the others, and never refuses the run (a device error then writes what it can)."""
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None, "this process had no CUDA context when the Recorder attached"
        names = None
        try:
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        except Exception:
            pass
        if self._model_device is not None:
            try:
                self._marks[self._model_device] = device_error.HostMarker(self._model_device)
            except Exception as e:
                self._warn("marker", f"reprokit: cannot place step markers on {self._model_device} ({e!r}); after a "
                                     "device error the bundle cannot say which step's kernels failed")
        if self._model_device is not None and self.state.scaler_enabled():
            check_scaler_layout(self._model_device)  # snapshots read its scale without a sync (once it passes)
        try:
            return names, host_format_problem(torch.cuda.current_device())
        except Exception as e:
            return names, f"checking the CUDA generator state's format failed ({e!r})"

    def _device_died(self, e: BaseException | str) -> None:
        """A CUDA call failed with a sticky error: from now on the recorder makes none (its own calls, that is), and
        its host buffers live to the end of the process (see :func:`reprokit.device_error.keep_to_exit`)."""
        if self._dead is None:
            self._dead = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            if self._marks or self._model_device is not None:
                device_error.keep_to_exit([self._engine.buffers(), self._pool.buffers(), list(self._marks.values())])

    def _last_marked(self) -> int | None:
        """The last step whose start marker has landed on every device that marks (-1: none has); None where no
        device marks (no CUDA): every copy was made on the host."""
        if not self._marks:
            return None
        lasts = [m.last() for m in self._marks.values()]
        return -1 if any(x is None for x in lasts) else min(x for x in lasts if x is not None)

    def _host_window(self, step: int) -> tuple[_Snapshot, list[_Step]] | str:
        """The window to write after the device died at (or, the host running ahead, before) ``step``: a snapshot
        whose copies landed and the steps since, up to the last step whose batch landed, read from host memory
        alone; or why there is none."""
        last = self._last_marked()
        end = step if last is None else min(step, last)
        if last == -1:
            return "no step's batch reached host memory before the device failed"
        snap = self._snapshot
        engine = self._engine
        current = self._window_ok and snap is not None and not engine.broken and not engine.torn and \
            engine.complete(snap.serial)
        kept = self._kept
        if current and snap is not None and self._ring and self._ring[0].step <= end:
            chosen, ring = snap, list(self._ring)
        elif kept is not None and engine.complete(kept.snapshot.serial):
            chosen, ring = kept.snapshot, [*kept.ring, *(self._ring if self._window_ok else [])]
        elif snap is not None and not engine.complete(snap.serial):
            why = "the previous one was not kept" + (
                " (twice the state does not fit host_memory_budget)" if not engine.keeps_last else "")
            return f"the snapshot copy of step {snap.step} had not landed when the device failed, and {why}"
        else:
            return "the recorded window is incomplete"
        ring = [r for r in ring if r.step <= end]
        if not ring or ring[-1].step != end:
            return f"step {end}'s batch is not in the recorded window"
        return chosen, ring

    def _dump_dead(self, failure: Failure, incident: str | None) -> Path | None:
        """The device died (a sticky error): write the bundle from host memory, never calling CUDA again (no
        synchronize, no event query, no copy off the device; the RNG states read at each step's start), as a
        ``device_error`` at the step whose kernels failed (the markers say which, where the error surfaced later)."""
        t0 = time.perf_counter()
        self._device_died(failure.message or failure.kind)
        if self._dead_bundle is not None:
            self._warn("dead", f"reprokit: {failure.describe()}; the device died earlier and its bundle is "
                               f"{self._dead_bundle}: no other bundle (nothing can be copied off the device)")
            return None
        surfaced = failure.step
        found = self._host_window(failure.step)
        if isinstance(found, str):
            self._warn("", f"reprokit: {failure.describe()}, but {found}; no bundle")
            return None
        snap, ring = found
        failure.step = ring[-1].step
        failure.detail = {**failure.detail, "device_error": {
            **failure.detail.get("device_error", {}),
            "error": self._dead, "surfaced_at_step": surfaced, "rank": self.rank.rank if self.rank else None,
            "snapshot": "previous (the snapshot of the failing step had not landed)" if snap is not self._snapshot
            else "current"}}
        if not self._host_rng and any(r.rng.cuda for r in ring):
            why = (f"the CUDA generators' state of the window's steps is not in the bundle ({self._host_rng_why}): "
                   "replay starts them fresh, so random numbers drawn on the GPU (dropout, sampling) may differ")
            failure.detail["device_error"]["cuda_rng"] = why
            self._warn("dead-rng", f"reprokit: {why}")
        path = self._write_bundle(failure, snap, ring, incident, host_only=True)
        if path is not None:
            self._dead_bundle = path
            self.dead_write_seconds = time.perf_counter() - t0
        return path

    def _note_batch(self, batch: Any, record: _Step | None) -> Any:
        """The batch the failure note diagnoses: ``batch`` itself, or its host copy (the recorded step, decoded) for a
        failure seen steps after it ran (no live batch) or once the device died (its GPU tensors cannot be read).
        None when neither is there: only the note depends on it."""
        if self._dead is None and batch is not None:
            return batch
        if record is None:
            return None
        try:
            return pytree.decode(record.batch, record.tensors)
        except Exception:
            return None

    def _write(self, w: BundleWriter, failure: Failure, ring: list[_Step] | None = None,
               incident: str | None = None, snap: _Snapshot | None = None, host_only: bool = False,
               lag: int = 0) -> Path:
        snap = self._snapshot if snap is None else snap
        assert snap is not None
        ring = self._ring if ring is None else ring
        code = [] if self._root is None else [(relative(p, self._root), p)
                                              for p in snapshot_files(self._root, self._scripts)]
        run = self._run_doc(snap, failure, ring, lag)
        if self.rank is not None:
            run["distributed"] = {**self.rank.to_json(), "incident": incident}
        env = capture_env(self._root, devices=self._device_names or []) if host_only else capture_env(self._root)
        # After a device error no CUDA call may run: the CUDA generators' state is made on the host where its format
        # was checked at attach, else left out (see _dump_dead, which says so in the failure's detail).
        steps = (r.record(host_only=host_only, cuda_rng=not host_only or self._host_rng) for r in ring)
        if snap.referenced:
            return self._write_referencing(w, failure, run, snap, ring, code, incident, env, steps)
        return write_bundle(w, failure=failure.to_json(), run=run, env=env,
                              state=(snap.tree, snap.tensors), steps=steps, code=code)

    def _write_referencing(self, w: BundleWriter, failure: Failure, run: dict[str, Any], snap: _Snapshot,
                           ring: list[_Step], code: list[tuple[str, Path]], incident: str | None,
                           env: dict[str, Any], steps: Iterator[StepRecord]) -> Path:
        """A bundle whose state is rank 0's: wait (bounded) for rank 0's bundle of this incident and reference its
        state files by digest; if there is none, the bundle says why (it cannot replay alone) and so does a warning."""
        assert self.rank is not None and isinstance(snap.tensors, dict)
        board = self._board
        ref, owner_tree = replicated.find_owner(
            w.out_dir, world_size=self.rank.world_size, incident=incident or "", step=snap.step,
            timeout_s=self.incident_wait_s,
            done=board.done_path(replicated.OWNER_RANK) if board is not None else None)
        if ref.get("problem"):
            self._warn("", f"reprokit: rank {self.rank.rank}'s bundle references rank {replicated.OWNER_RANK}'s state,"
                           f" but {ref['problem']}. It is written without a state and cannot replay alone; replay "
                           "the incident's other bundles, or record with replicated_state=False.")
        return write_bundle(w, failure=failure.to_json(), run=run, env=env,
                            state=({**snap.tree, "state": owner_tree}, snap.tensors),
                            steps=steps, code=code, reference=ref)

    def _run_doc(self, snap: _Snapshot, failure: Failure, ring: list[_Step] | None = None,
                 lag: int = 0) -> dict[str, Any]:
        ring = self._ring if ring is None else ring
        # Steps after this rank's failing one (run while its check was on its way) are in no window, nor in the history.
        last = None if failure.kind == FailureKind.PEER else failure.step
        return {
            **self._run_base(),
            "window": {"start": snap.step, "end": ring[-1].step if ring else failure.step,
                       "steps": [r.step for r in ring]},
            "detected_lag": lag,
            "history": [{"step": s, "loss": loss, "grad_norm": g, "lr": lr, "loss_scale": scale}
                        for s, loss, g, lr, scale in self._history if last is None or s <= last],
        }

    def _run_base(self) -> dict[str, Any]:
        """``run.json`` without the window and the history (what a flight log writes once, at attach)."""
        determinism, precision = split_flags(determinism_flags())
        device = next((str(p.device) for p in self.state.model.parameters()), "cpu")
        return {
            "refs": self._refs,
            "config": self._config,
            "recorder": {"snapshot_every": self.snapshot_every, "max_lag": self.monitor.checks.max_lag,
                         "detect": self.settings.to_json(), "memory": self.stats()},
            "determinism": determinism,
            "precision": precision,
            "device": device,
            "model": self._tables,
        }

    # --- helpers ------------------------------------------------------------------------

    def _predicate_ref(self, fn: Predicate) -> dict[str, Any] | None:
        try:
            return ref_of(fn, "detect")[0]
        except CaptureError:
            warnings.warn(f"reprokit: predicate {fn!r} is not a module-level function; bundles will record it "
                          "but replay cannot re-check it", RecorderWarning, stacklevel=3)
            return None

    def _warn(self, key: str, message: str) -> None:
        """Warn once per ``key``; an empty key always warns."""
        if not key or key not in self._warned:
            self._warned.add(key)
            try:
                warnings.warn(message, RecorderWarning, stacklevel=3)
            except Exception:  # warnings turned into errors (-W error): still never raise into the training loop
                print(message, file=sys.stderr)

    def detach(self) -> None:
        """Stop watching (remove the optimizer hooks) but keep buffers, window and snapshot; see :meth:`attach`."""
        self.monitor.close()
        self._engine.detach()

    def attach(self) -> None:
        """Watch again after :meth:`detach` (say, after an evaluation loop that calls the optimizer)."""
        self.monitor.attach()
        self._engine.attach()

    def close(self) -> None:
        """Judge the steps whose checks are still on their way (:meth:`wait_for_checks`), then detach from the
        optimizer, stop the incident watcher and free the window.

        Raises:
            TrainingFailure: one of those steps' checks fired (its bundle is written first).
        """
        seen: TrainingFailure | None = None
        try:
            if self._dead is None:  # once the device died no check can be read (and its bundle is written)
                self.wait_for_checks()
        except TrainingFailure as e:
            seen = e
        except Exception as e:  # never let a fault of ours stop the close
            self._warn("", f"reprokit: could not judge the last steps' checks at close ({e!r})")
        self._close()
        if seen is not None:
            raise seen

    def report_device_error(self, exc: BaseException) -> Path | None:
        """Write the bundle of a sticky device error that surfaced outside the recorder's calls.

        The kernels of a step run after :meth:`step` returns, so a device-side assert (an index out of range in an
        embedding or ``cross_entropy``, an illegal memory access) usually reaches the host at the loop's next
        synchronizing call: the next batch's ``.to(device)``, a ``.item()``. The bundle is written from host memory
        alone, as when the error surfaces inside :meth:`step`, at the step whose kernels failed (the step markers
        say which). This runs by itself for an exception that ends the process uncaught, for the exception of a
        ``with Recorder(...)`` block, and at exit when the device died (see :mod:`reprokit.late_device_errors`);
        call it where your code catches such an error and goes on.

        Returns:
            The bundle's path (also added to ``exc`` as a note), or None: ``exc`` is no sticky device error, the
            recorder was closed or ran no step, or no window could be written (the note says so; tried once per
            recorder).
        """
        if not device_error.is_sticky(exc) or self._model_device is None:
            return None
        if self._dead_bundle is not None:  # written when the error surfaced in a step, or on an earlier report
            note = f"reprokit: bundle written to {self._dead_bundle}"
            if note not in getattr(exc, "__notes__", []):
                _add_note(exc, note)
            return self._dead_bundle
        if self._late_reported or self._closed or (self.step_index == 0 and not self._in_step):
            return None
        self._late_reported = True
        k = self.step_index if self._in_step else self.step_index - 1  # the last step started (or the markers')
        failure = from_exception(exc, k)
        inc = self._incidents
        if inc is not None:  # under a process group: the incident machinery, as for an error inside a step
            inc.failed_at = k
            path = inc.dump(failure)
        else:
            with self._lock:  # the incident watcher's thread may write the same window
                path = self._dump(failure)
        _add_note(exc, f"reprokit: bundle written to {path}" if path else
                  "reprokit: the device failed after the last recorded step, and no bundle could be written")
        return path

    def _exit_probe(self) -> None:
        """At exit (:mod:`reprokit.late_device_errors`): where the model's device died and no bundle says so yet,
        write it. One stream query, which never waits (a rank blocked in a collective exits as it would have)."""
        if self._dead_bundle is not None or self._late_reported or self._model_device is None:
            return
        try:
            torch.cuda.current_stream(self._model_device).query()
        except Exception as e:
            if device_error.is_sticky(e):
                path = self.report_device_error(e)
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                print(f"reprokit: at exit the device had failed ({first}); " +
                      (f"bundle written to {path}" if path else "no bundle could be written"), file=sys.stderr)

    def _close(self) -> None:
        self._closed = True
        late_device_errors.forget(self)
        if self._board is not None:
            self._board.close()
        if self._flight is not None:
            self._flight.close(remove=True)  # a run that ends normally leaves nothing on disk
            self._flight = None
        if self._dead is not None:
            self._close_dead()
        else:
            self.monitor.close()
            self._engine.close()
        self._ring.clear()
        self._pool.clear()
        self._kept = None
        self._ring_other = 0
        self._snapshot = None

    def _close_dead(self) -> None:
        """:meth:`close` after a sticky device error: no CUDA call (the host buffers were kept to the end of the
        process when the device died: see :meth:`_device_died`)."""
        with contextlib.suppress(Exception):
            self.monitor.close()  # its hooks are removed first; its last stream wait fails on the dead context
        self._engine.abandon()

    @property
    def snapshot_stats(self) -> dict[str, Any]:
        """Bytes, pinned host bytes and host seconds of the last snapshot (for benchmarks)."""
        return dict(self._engine.stats)
