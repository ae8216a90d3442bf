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
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
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

from reprokit import device_error, pytree, skip
from reprokit.bundle import (
    BundleWriter,
    StepRecord,
    find_leftovers,
    verify,
    write_bundle,
    write_probe,
)
from reprokit.bundle.layout import bundle_name
from reprokit.bundle.tensorfile import WrittenFile
from reprokit.code import importing_for_replay, ref_of, relative, snapshot_files
from reprokit.detect import DetectSettings, Monitor, Predicate, StepResult
from reprokit.diagnose import failure_note, model_tables
from reprokit.distributed import IncidentBoard, rank_info, replicated, sees_rank0
from reprokit.distributed import abort as fail_fast
from reprokit.distributed.peers import BEAT_EVERY_S, PEER_TIMEOUT_S, Death, PeerWatch
from reprokit.env import capture_env, determinism_flags, split_flags
from reprokit.errors import CaptureError, CodeLoadError, ConfigError, PeerFailure, RecorderWarning, TrainingFailure
from reprokit.flight import FlightLog
from reprokit.flight import run_id as flight_run_id
from reprokit.rng import RNGState, check_generators, host_format_matches
from reprokit.rng import capture as capture_rng
from reprokit.rng import encode as encode_rng
from reprokit.signature import Failure, FailureKind
from reprokit.snapshot import SnapshotEngine, mib
from reprokit.state import TrainState, accumulation_phase, capture_state

StepFn = Callable[[TrainState, Any], Any]

SPILL_DIR = ".reprokit-spill"
INCIDENT_GRACE_S = 1.0
"""How long a rank's incident watcher waits for its own main thread to report a failure of its own."""
PEER_EXIT_S = 1.0
"""How long a rank whose step raised looks for a dead peer on its host (a collective broken by a peer's death can
arrive while the kernel is still tearing that peer down, before its lock is released)."""
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

    def record(self, host_only: bool = False) -> StepRecord:
        rng_tree, rng_tensors = encode_rng(self.rng, host_only=host_only)
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
        detect: extra predicates ``fn(step, loss, state) -> bool | str``; truthy fails.
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
    ):
        if snapshot_every < 1:
            raise ConfigError(f"snapshot_every must be >= 1, got {snapshot_every}")
        if not isinstance(peer_timeout_s, (int, float)) or isinstance(peer_timeout_s, bool) or not peer_timeout_s > 0:
            raise ConfigError.option("peer_timeout_s", f"{{opt}} must be a positive number of seconds, got "
                                                       f"{peer_timeout_s!r}")
        self.peer_timeout_s = float(peer_timeout_s)
        self._peers: PeerWatch | None = None
        """Under a process group with ``durable=True``: this rank's check of its peers' flight folders."""
        self._waiting: tuple[int, float] = (-1, 0.0)
        """(step, monotonic time) at which the watcher first saw this rank inside that step."""
        self._beat_at = 0.0
        self._skips = skip.Skipper(skip.SkipSettings(
            on_failure=on_failure, skip_budget_s=skip_budget_s, max_skips=max_skips, skip_window=skip_window,
            skip_indices=skip.as_indices(skip_indices)), Path(out_dir))
        self.on_incident = fail_fast.check_on_incident(on_incident)
        self._peer_doc: dict[str, Any] | None = None
        """The incident whose window this rank's watcher wrote as a peer's (this rank had not failed itself)."""
        self._peer_step: int | None = None
        """The step this rank was at when its watcher wrote that window."""
        self._failed_at: int | None = None
        """The last step at which this rank failed itself."""
        self._aborted: dict[str, Any] | None = None
        """The incident after which this rank's part of the run was ended (``on_incident="abort"``)."""
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
        self._history: deque[tuple[int, float | None, float | None, float | None, float | None]] = deque(
            maxlen=loss_history)
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
        self.monitor = Monitor(state, self.settings, detect)  # from here on, hooks are on the user's optimizer
        try:
            self._set_up(state, detect, spill_dir, snapshot_sync, incident_wait_s, replicated_state)
        except BaseException:
            self._refused()  # a refused Recorder leaves nothing on the user's optimizer (or watching the out_dir)
            raise

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _set_up(self, state: TrainState, detect: Sequence[Predicate], spill_dir: str | Path | None,
                snapshot_sync: bool, incident_wait_s: float, replicated_state: str | bool) -> None:
        """The part of ``__init__`` that runs once the monitor's hooks are on the optimizer (see :meth:`_refused`)."""
        self._tables = model_tables(state.model)  # table sizes for the batch diagnosis (inspect, failure note)
        self._engine = SnapshotEngine(state, spill_dir, sync=snapshot_sync, limit=self.budget * 3 // 4,
                                      fallback_spill_dir=self.out_dir / SPILL_DIR)
        self._model_device = next((p.device for p in state.model.parameters() if p.is_cuda), None)
        self._device_names, self._host_rng = self._read_devices()
        self._engine.others = self._room_for_snapshot
        self._flat_batch: tuple[list[str], dict[str, Any], list[str]] | None = None
        """(keys, encoded tree, tensor keys) of the last batch when it was a flat dict of tensors."""
        self._slots: dict[tuple[int, int], torch.Tensor] = {}
        """Host buffers the batches are copied into, per (position in the window, leaf): reused window after window,
        so that steady state allocates nothing (a fresh large buffer costs its page faults every step)."""
        self._slot = self._leaf = 0
        self._copied: set[torch.device] = set()
        """CUDA devices this step's batch tensors were copied from (device to host, on their training streams)."""
        self._marks: dict[torch.device, device_error.HostMarker] = {}
        """Per CUDA device: the last step whose start (its batch copies, and everything queued before them on the
        training stream) has run, in pinned host memory (see :mod:`reprokit.device_error`)."""
        self._landed: dict[torch.device, torch.cuda.Event] = {}
        """Durable recording only: recorded on the training stream after the last step's batch copies."""
        self._kept: _Kept | None = None
        self._spares: dict[tuple[int, int], torch.Tensor] = {}
        """Batch buffers swapped out of ``_slots`` while the kept window's steps still use them (see _batch_copy)."""
        self._dead: str | None = None
        """The sticky device error after which the recorder touches the GPU no more."""
        self._dead_bundle: Path | None = None
        self.dead_write_seconds: float | None = None
        """Seconds the bundle took to write after a sticky device error (from the failure to the bundle on disk)."""
        self._pool = {"pinned": 0, "pageable": 0}
        """Bytes of the batch buffers in ``_slots``."""
        self._bytes_at: dict[int, int] = {}
        """Bytes of the batch buffers per position in the window."""
        self._ring_other = 0
        """Bytes the window holds outside the pool: RNG states, numpy leaves of batches."""
        self._mem = {"peak_pinned_bytes": 0, "peak_pageable_bytes": 0, "early_snapshots": 0, "unrecorded_steps": 0}
        self._opt_entries = -1  # len(optimizer.state) when buffers were last pinned aside for it
        self.step_index = 0
        self.bundles: list[Path] = []
        self._snapshot: _Snapshot | None = None
        self._ring: list[_Step] = []
        self._window_ok = False
        self._open: tuple[Any, _Step | None] | None = None
        """The batch and record of the step :meth:`begin_step` opened, until :meth:`end_step`."""
        self._resnap = False  # take a snapshot at the next synced step (see reprokit.state.accumulation_phase)
        self._warned: set[str] = set()
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
        self._lock: Any = contextlib.nullcontext()
        self._stepped_since_incident = True
        """This rank finished a step since the last incident it handled: a failure now is a new incident."""
        self._incident_bundle: Path | None = None
        """This rank's bundle of the last incident it handled."""
        if self.rank is not None:
            self._lock = threading.RLock()  # the incident watcher writes the window from another thread
            self._board = IncidentBoard(self.out_dir, self.rank)
            self._board.attach()
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
        if self._board is not None:
            self._board.watch(self._on_incident, tick=self._watch_peers if self._peers is not None else None)

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
            if self.rank is not None and self.rank.world_size > 1:
                self._peers = PeerWatch(self._flight.run_folder, self.rank.rank, self.rank.world_size,
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
            TrainingFailure: when a detector fires; ``.bundle`` is the bundle path.
        """
        batch = self._skips.filter(batch, self.step_index)
        record = self._begin_step(batch)
        result = self.monitor.run(self.train_step, batch, self.step_index, after=self._locked_after_step)
        if result.exc is not None and self._peers is not None:
            self._await_dead_peer(result.exc)
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
        if result.exc is not None and self._peers is not None:
            self._await_dead_peer(result.exc)
        # on_failure="skip" never skips an exception handed in here: it has already left the framework's loop.
        self._skips.exceptions_end_the_loop = skip.CAUGHT_BY_THE_CALLER if exc is not None else None
        try:
            return self._finish_step(batch, record, result)
        finally:
            self._skips.exceptions_end_the_loop = None

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
        if self._aborted is not None:  # a peer failed and this rank's part of the run was ended (on_incident)
            raise self._peer_failure(self._aborted)
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
        peer_error = self._peer_doc is not None and result.exc is not None and self.on_incident == "abort"
        if result.failure is not None and not peer_error:
            self._failed_at = k  # before the step is over: the incident watcher reads it then (_end_after_incident)
        self.step_index += 1
        self._in_step = False
        try:
            self._engine.check()
        except Exception as e:  # a device error; the step's own outcome below is what the user sees
            self._engine.broken = True
            self._warn("check", f"reprokit: cannot check the snapshot copy ({e!r}); no bundle until the next snapshot")
        if record is not None:
            record.loss, record.grad_norm = result.loss, result.grad_norm
        if self._flight is not None and record is not None:
            self._flight.record(b"end ", {"step": k, "loss": _plain(result.loss), "grad_norm": _plain(result.grad_norm),
                                          "failed": result.failure is not None})
        self._history.append((k, result.loss, result.grad_norm, *_lr_and_scale(self.state, self.monitor.last_scale)))
        if result.failure is None:
            self._stepped_since_incident = True
            return result.value
        if peer_error and self._peer_doc is not None:
            raise self._peer_failure(self._peer_doc) from result.exc
        path = self._dump(result.failure) if self._board is None else self._dump_incident(result.failure)
        attempt = self._skips.after_failure(self, result.failure, record, path) if self._skips.on else None
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
        failure = TrainingFailure(result.failure, path)
        for line in (hint, why_not, nxt):
            if line:
                _add_note(failure, line)
        raise failure

    def _record_step_start(self, k: int, batch: Any) -> _Step | None:
        """Copy the batch and read the RNG; take the snapshot when one is due (after the batch copy is queued, so on
        a GPU the batch's small copy does not wait behind the state's). On a GPU, a marker follows the batch copies
        on the training stream (see :meth:`_mark_start`). Once the device died, nothing (no CUDA call)."""
        if self._dead is not None:
            return None
        self._copied.clear()
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
            if not due:
                self._engine.discard_prepared()  # prepared for a snapshot that is not taken now: stale later
            if not due and not self._window_ok:
                return None
            rng = capture_rng(self.state.extra)  # before anything can draw: the state this step starts from
            batch_bytes, other = _batch_bytes(batch)
            other += RNG_STEP_BYTES * (1 + len(rng.owned))
            need = batch_bytes + other
            position = 0 if due else k - self._snapshot.step  # type: ignore[union-attr]
            if not self._fits(k, position, need):
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
            self._slot, self._leaf = position, 0
            if self._flight is not None:
                self._flight.reserve(position)  # the record one window ago that reads these buffers is written
            if due:
                self._keep_window()
            tree, tensors = self._encode_batch(batch)
            later = bool(self._copied)
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

    def _encode_batch(self, batch: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        """``pytree.encode(batch, "batch", copy=self._batch_copy)``; a dict of dense tensors with last step's keys
        reuses last step's tree (most loops feed the same dict every step)."""
        flat = self._flat_batch
        if flat is not None and type(batch) is dict and len(batch) == len(flat[0]) and all(
                k is f or k == f for k, f in zip(batch, flat[0])):
            values = batch.values()
            if all(type(v) is torch.Tensor and v.layout is torch.strided for v in values):
                return flat[1], {key: self._batch_copy(v) for key, v in zip(flat[2], values)}
        tree, tensors = pytree.encode(batch, "batch", copy=self._batch_copy)
        flat_keys = [f"batch/{k}" for k in batch] if type(batch) is dict else []
        self._flat_batch = None
        if flat_keys and all(type(k) is str for k in batch) and tree == {
                k: {pytree.TENSOR: key} for k, key in zip(batch, flat_keys)} and list(tensors) == flat_keys:
            self._flat_batch = (list(batch), tree, flat_keys)
        return tree, tensors

    def _batch_copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` as it is now, in a host buffer reused window after window.

        A CPU tensor is copied here. A CUDA tensor is copied into its pinned host buffer on the
        training stream (``non_blocking``: the host goes on), so the step's kernels, and any later
        refill of the batch, are ordered after the copy: it has landed before any of the step's
        kernels can fail (:meth:`_mark_start` tells the host when, without asking the device).

        While the previous window is kept (its snapshot's successor may still be copying), a
        buffer one of its steps holds is not written: a spare one takes its place.
        """
        key = (self._slot, self._leaf)
        self._leaf += 1
        slot = self._slots.get(key)
        if self._kept is not None and key[0] < len(self._kept.ring) and slot is not None:
            slot = self._swap_slot(key, slot)
        if slot is None or slot.shape != t.shape or slot.dtype != t.dtype:
            if slot is not None:
                self._free_slot(key)
            slot = self._new_slot(key, t)
        if t.requires_grad:
            t = t.detach()
        if not t.is_cuda:
            return slot.copy_(t)
        self._copied.add(t.device)
        return slot.copy_(t, non_blocking=True)

    def _swap_slot(self, key: tuple[int, int], held: torch.Tensor) -> torch.Tensor | None:
        """The buffer at ``key`` is held by a kept step: put the spare of ``key`` in its place (None: there is none,
        the caller makes one), and keep the held one as the spare (free for the next swap once the kept window is
        dropped). Spares count as held host memory, not as any position's."""
        spare = self._spares.pop(key, None)
        self._spares[key] = held
        self._count_slot(key, held, -1, pool=False)
        if spare is None:
            del self._slots[key]
            return None
        self._slots[key] = spare
        self._count_slot(key, spare, 1, pool=False)
        return spare

    def _free_spares(self) -> None:
        """Free the spare batch buffers (none is held once the kept window is dropped)."""
        self._kept = None
        for key in list(self._spares):
            self._count_slot(key, self._spares.pop(key), -1, at=False)

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
        devices = set(self._copied)
        if self._model_device is not None:
            devices.add(self._model_device)
        for device in devices:
            mark = self._marks.get(device)
            if mark is None:
                mark = self._marks[device] = device_error.HostMarker(device)
            mark.mark(k)
        if self._flight is not None and self._copied:
            for device in self._copied:
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
                                    [self._landed[d] for d in self._copied if d in self._landed])
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
        if snap is not None and self.step_index + 1 - snap.step >= self.snapshot_every and not self._refer:
            self._engine.prepare()

    # --- the host-memory budget ------------------------------------------------------

    def held_bytes(self) -> int:
        """Host memory the recorder holds now: snapshot, batch-buffer pool, the window's RNG states (and the kept
        window's, while its successor's snapshot copies)."""
        kept = self._kept.other if self._kept is not None else 0
        return self._engine.held_bytes + self._pool["pinned"] + self._pool["pageable"] + self._ring_other + kept

    def _fits(self, k: int, position: int, need: int, early: bool = False) -> bool:
        """Whether step ``k``'s ``need`` bytes fit the budget at ``position`` of the window, after freeing buffers the
        window does not use. ``early``: the window would restart here (an early snapshot; said once)."""
        if self._projected(position, need) <= self.budget:
            fits = True
        else:
            for key in [key for key in self._slots if key[0] > position]:
                self._free_slot(key)
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
        return (self._engine.held_bytes + self._pool["pinned"] + self._pool["pageable"]
                - self._bytes_at.get(position, 0) + window_other + need)

    def _room_for_snapshot(self, make_room: bool) -> int:
        """Bytes the budget leaves for a snapshot being taken now: the window restarts with this step (position 0),
        so buffers of later positions are unused and, with ``make_room``, freed."""
        if make_room:
            for key in [key for key in self._slots if key[0] > 0]:
                self._free_slot(key)
            self._free_spares()  # the budget first: a window kept for a device error is a nicety
        return self.budget - self._pool["pinned"] - self._pool["pageable"] - self._current_other

    def _new_slot(self, key: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
        """A batch buffer for ``like`` at (position, leaf) ``key``: pinned for a CUDA tensor, counted in the pool."""
        slot = self._slots[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)
        self._count_slot(key, slot, 1)
        return slot

    def _free_slot(self, key: tuple[int, int]) -> None:
        self._count_slot(key, self._slots.pop(key), -1)

    def _count_slot(self, key: tuple[int, int], slot: torch.Tensor, sign: int, pool: bool = True,
                    at: bool = True) -> None:
        """Count a batch buffer in (``sign`` 1) or out of the pool's bytes (``pool``) and its position's (``at``)."""
        n = sign * slot.numel() * slot.element_size()
        if pool:
            self._pool["pinned" if slot.is_pinned() else "pageable"] += n
        if at:
            self._bytes_at[key[0]] = self._bytes_at.get(key[0], 0) + n

    def _note_peak(self) -> None:
        e = self._engine.stats
        self._mem["peak_pinned_bytes"] = max(self._mem["peak_pinned_bytes"], e["pinned_bytes"] + self._pool["pinned"])
        self._mem["peak_pageable_bytes"] = max(self._mem["peak_pageable_bytes"],
                                               e["pageable_bytes"] + self._pool["pageable"] + self._ring_other)

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

        Example:
            >>> rec.stats()["peak_pinned_bytes"]                             # doctest: +SKIP
            1598029824
        """
        window = sum(t.numel() * t.element_size() for key, t in self._slots.items() if key[0] < len(self._ring))
        return {"budget_bytes": self.budget, "held_bytes": self.held_bytes(), **self._mem,
                "snapshot_bytes": self._engine.held_bytes, "window_steps": len(self._ring),
                "window_bytes": window + self._ring_other, "snapshots_spilled": self._engine.spilled_for_memory,
                "state": "referenced" if self._refer else "snapshotted", "state_bytes_saved": self._saved}

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

    def _next_snapshot(self, k: int) -> int:
        start = self._snapshot.step if self._snapshot else k
        return start + self.snapshot_every * ((k - start) // self.snapshot_every + 1)

    # --- on failure ---------------------------------------------------------------

    # --- incidents (several ranks) -----------------------------------------------------

    def _locked_after_step(self) -> None:
        with self._lock:
            self._after_step()

    def _dump_incident(self, failure: Failure) -> Path | None:
        """This rank failed: declare the incident (or join the one a peer declared), write this rank's window into
        the incident folder unless the watcher already did, then wait (bounded) for every rank to write its own.

        A failure in the step this rank was in when an incident came (a peer that failed and left this rank's
        collective hanging, or the NaN a peer all-reduced into this rank's gradients) belongs to that incident; once
        this rank has finished a step since, a failure is a new incident (a loop that skipped the failing step)."""
        board = self._board
        assert board is not None and self.rank is not None
        with self._lock:
            if board.current is not None and not self._stepped_since_incident:
                doc, path = board.current, self._incident_bundle
            else:
                try:
                    doc = board.declare(failure.step, self.rank.rank, failure.describe())
                except OSError as e:  # never let our bookkeeping replace the training's own error
                    self._warn("", f"reprokit: {failure.describe()}, but the incident could not be declared under "
                                   f"{board.path.parent} ({e!r}); no bundle")
                    return None
                board.handle(doc)
                self._stepped_since_incident = False
                failure.detail = {**failure.detail, "incident": doc}
                path = self._incident_bundle = self._dump(failure, incident=doc["incident"])
                board.done(self.rank.rank)
        self._peer_doc = None  # this rank failed itself: its own error is raised
        board.mark_outcome(self.rank.rank, "failed")
        missing = board.wait_for_all(self.incident_wait_s)
        if missing:
            self._warn("", f"reprokit: incident {doc['incident']}: ranks {missing} did not write their window within "
                           f"{self.incident_wait_s:.0f} s")
        if self.on_incident == "abort":
            self._abort_with_peers(doc)
        return path

    def _on_incident(self, doc: dict[str, Any]) -> None:
        """Watcher thread: a peer failed; write this rank's window as it is now (a peer's failure, not this rank's)."""
        board = self._board
        assert board is not None and self.rank is not None
        # A rank whose own detector fires at the same step (a NaN all-reduced into its gradients) is about to write
        # its own failure: give its main thread a moment before writing this rank's window as a peer's. (A peer that
        # died outright is the whole incident: no wait.)
        if "died" not in doc:
            time.sleep(INCIDENT_GRACE_S)
        with self._lock:
            if board.seen == doc["incident"] or int(doc["number"]) < board.handled:
                return
            board.handle(doc)
            self._stepped_since_incident = False
            step = max(self.step_index, self._ring[-1].step if self._ring else self.step_index)
            failure = Failure(kind=FailureKind.PEER, step=int(doc.get("step", step)),
                              message=f"rank {doc.get('rank')} failed: {doc.get('what')}",
                              detail={"incident": doc, "this_rank_step": step})
            self._incident_bundle = self._peer_window(failure, doc)
            board.done(self.rank.rank)
            self._peer_doc, self._peer_step = doc, self.step_index
        if self.on_incident == "abort":
            self._end_after_incident(doc, self._peer_step)

    def _watch_peers(self) -> None:
        """Watcher thread, before each look for incidents (durable, under a process group): rewrite this rank's
        heartbeat (every ``BEAT_EVERY_S``), and declare the incident of a peer found dead (its pid gone and its lock
        released on this host; elsewhere its heartbeat older than ``peer_timeout_s`` while this rank waits); the
        look that follows handles it as any incident."""
        flight, board, watch = self._flight, self._board, self._peers
        if flight is None or board is None or watch is None:
            return
        now = time.monotonic()
        k, in_step = self.step_index, self._in_step
        if now - self._beat_at >= BEAT_EVERY_S:
            self._beat_at = now
            flight.beat(k if in_step else k - 1)
        if self._waiting[0] != k or not in_step:
            self._waiting = (k if in_step else -1, now)
        if self._aborted is not None or board.pending() is not None:
            return
        waited = now - self._waiting[1] if in_step else 0.0
        for death in self._new_deaths(watch.dead(waiting_s=waited)):
            self._declare_death(death)

    def _new_deaths(self, deaths: list[Death]) -> list[Death]:
        """``deaths`` without the ranks whose window of the incident this rank is still in is written: a rank that
        failed itself and then ended (its launcher's SIGTERM, the gloo abort's ``os._exit``) is no new incident."""
        board = self._board
        if board is None or board.current is None or self._stepped_since_incident:
            return deaths
        return [d for d in deaths if not board.done_path(d.rank).exists()]

    def _declare_death(self, death: Death) -> dict[str, Any] | None:
        """Rank ``death.rank`` died without writing an incident: declare one for it (or join the one a peer declared
        first), mark it dead (no rank waits for its window) and say so in the incident folder; ``reprokit recover``
        writes its window there from its flight log."""
        board = self._board
        assert board is not None
        step = death.last_started if death.last_started is not None else self.step_index
        try:
            doc = board.declare(step, death.rank, death.what(), died=death.to_json())
        except OSError as e:
            self._warn("", f"reprokit: {death.what()}, but the incident could not be declared under "
                           f"{board.path.parent} ({e!r})")
            return None
        board.mark_dead(death.rank, death.to_json())
        died: dict[str, Any] = doc["died"] if isinstance(doc.get("died"), dict) else death.to_json()
        try:
            folder = self.out_dir / str(doc["incident"])
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"died-rank{death.rank}.json"
            tmp = folder / f".{path.name}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps({**died, "incident": doc["incident"], "what": death.what(),
                                       "recover": f"reprokit recover {self.out_dir}"}, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # the incident file and every rank's bundle say it too
        print(f"reprokit: rank {death.detected_by}: {death.what()}; incident {self.out_dir / str(doc['incident'])}; "
              f"its window: `reprokit recover {shlex.quote(str(self.out_dir))}` once the job has ended",
              file=sys.stderr, flush=True)
        return doc

    def _await_dead_peer(self, exc: BaseException) -> None:
        """Main thread, the step raised ``exc`` (durable, under a process group). A collective broken by a peer's
        death (gloo raises as soon as the peer's sockets close) reaches this rank within moments of it: when a peer on
        this host is dead (for a ``RuntimeError``, the type collectives raise, looked for up to ``PEER_EXIT_S`` while
        the peer's process is still torn down) or a death incident is pending, wait (bounded) until the watcher has
        written this rank's window for it, so that the step raises :class:`PeerFailure` (``on_incident="abort"``),
        or this rank's error joins that incident (``"wait"``)."""
        board, watch = self._board, self._peers
        if board is None or watch is None or self._peer_doc is not None:
            return
        deadline = time.monotonic() + (PEER_EXIT_S if isinstance(exc, RuntimeError) else 0.0)
        doc = None
        while doc is None:
            current, pending = board.current, board.pending()
            if current is not None and "died" in current and not self._stepped_since_incident:
                doc = current  # the watcher is handling it (or has) since this step began
                break
            if pending is not None:
                if "died" not in pending:
                    return  # a peer's raised failure: the usual path decides
                doc = pending
                break
            for death in self._new_deaths(watch.dead(remote=False)):
                doc = self._declare_death(death) or doc
            if doc is None:
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.05)
        deadline = time.monotonic() + 2 * board.poll_s + 5.0
        while board.seen != doc["incident"] and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:  # the watcher writes this rank's window holding it
            pass

    def _peer_window(self, failure: Failure, doc: dict[str, Any]) -> Path | None:
        """Watcher thread: this rank's window of a peer's incident. Of a peer that died outright, the window must
        start where the dead rank's flight log has one (``reprokit recover`` writes the dead rank's from there, and
        an incident replays only when every rank's window starts at one step): a rank killed just after a snapshot
        had not yet committed it, so its newest window starts one snapshot earlier. Then this rank's window is
        written from its own flight log, which keeps that earlier window too (see :mod:`reprokit.flight`)."""
        died, flight, snap = doc.get("died"), self._flight, self._snapshot
        incident = str(doc["incident"])
        if not isinstance(died, dict) or flight is None or snap is None:
            return self._dump(failure, incident=incident, from_watcher=True)
        from reprokit.recover import read_rank, window_chain, write_window

        try:
            theirs = window_chain(read_rank(flight.run_folder / f"rank{died.get('rank')}"))
            if isinstance(theirs, str) or theirs[0] >= snap.step:
                return self._dump(failure, incident=incident, from_watcher=True)
            mine = read_rank(flight.folder)
            chain = window_chain(mine, theirs[0])
            if isinstance(chain, str):
                self._warn("", f"reprokit: rank {died.get('rank')}'s flight log holds a window from step {theirs[0]} "
                               f"only, and this rank's own log has none from there ({chain}); this rank's window "
                               f"starts at step {snap.step}, so `reprokit recover` cannot line rank "
                               f"{died.get('rank')}'s window up with it")
                return self._dump(failure, incident=incident, from_watcher=True)
            path = write_window(mine, self.out_dir / incident, chain, failure, incident=incident)
        except Exception as e:  # never let our bookkeeping stop the run: the window from memory still serves
            self._warn("", f"reprokit: could not write this rank's window from its flight log ({e!r}); writing the "
                           "one in memory")
            return self._dump(failure, incident=incident, from_watcher=True)
        self.bundles.append(path)
        flight.record(b"bndl", {"step": failure.step, "path": str(path.absolute()), "incident": incident,
                                "kind": failure.kind})
        return path

    def _end_after_incident(self, doc: dict[str, Any], at: int) -> None:
        """Watcher thread, ``on_incident="abort"``: this rank's window of a peer's incident is written (it was at
        step ``at``). Once every rank's window is, end this rank's part of the run unless its own step failed in the
        same incident: abort the process group, so that a collective it is blocked in returns with an error (and its
        next step raises :class:`PeerFailure` otherwise); under gloo, end the process if it stays blocked."""
        board, info = self._board, self.rank
        assert board is not None and info is not None
        missing = board.wait_for_all(self.incident_wait_s)
        deadline = time.monotonic() + fail_fast.ABORT_GRACE_S
        while self._in_step and self.step_index == at and time.monotonic() < deadline:
            time.sleep(0.02)
        if self._failed_at is not None and self._failed_at >= at:
            return  # its own failure in this incident is what its loop sees (and may catch and go on from)
        incident = self.out_dir / str(doc["incident"])
        checked = self._verified(self._incident_bundle)
        self._aborted = {**doc, "missing": missing}
        board.mark_outcome(info.rank, "abort")
        blocked = self._in_step and self.step_index == at
        lines = [f"reprokit: rank {info.rank}: rank {doc.get('rank')} failed at step {doc.get('step')} "
                 f"({doc.get('what')}); incident: {incident}", f"reprokit: rank {info.rank}'s window: {checked}"]
        if missing:
            lines.append(f"reprokit: ranks {missing} wrote no window within {self.incident_wait_s:.0f} s "
                         "(incident_wait_s); the others' are in the incident folder")
        interrupts = fail_fast.abort_interrupts(info.backend)
        if interrupts:
            why = fail_fast.abort_process_group()
            lines.append(f"reprokit: rank {info.rank} aborted its process group (on_incident=\"abort\"; "
                         "on_incident=\"wait\" keeps it waiting)" if why is None else
                         f"reprokit: rank {info.rank} could not abort its process group: {why}")
        print("\n".join(lines), file=sys.stderr, flush=True)
        if not blocked:
            return  # its collective broke by itself, or it is outside a step: its next step raises PeerFailure
        deadline = time.monotonic() + fail_fast.UNBLOCK_S
        while self._in_step and self.step_index == at and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._in_step and self.step_index == at:  # gloo cannot abort a blocked call; the process's end does
            why = "its process group was aborted, yet the call has not returned" if interrupts else \
                "gloo cannot abort a blocked call"
            fail_fast.end_process(
                f"reprokit: rank {info.rank} is still blocked in step {at}'s collective {fail_fast.UNBLOCK_S:.0f} s "
                f"after every window was written; {why}, so it ends its process (exit 1, on_incident=\"abort\"; "
                f"on_incident=\"wait\" keeps it waiting). Every rank's window: "
                f"`reprokit replay {shlex.quote(str(incident))}`")

    def _abort_with_peers(self, doc: dict[str, Any]) -> None:
        """Main thread, this rank failed itself (``on_incident="abort"``): when a peer aborts, abort this rank's
        process group too, before its own error is raised, so that its exit path (``dist.destroy_process_group()``
        under NCCL, a ``dist.barrier()``) does not wait for peers that are gone. Not under gloo, whose abort does not
        interrupt a blocked call (the peers' processes ending does); not when every rank failed itself (a loop that
        catches the failure may go on)."""
        board, info = self._board, self.rank
        assert board is not None and info is not None
        if not fail_fast.abort_interrupts(info.backend):
            return
        others = [r for r in board.recording_ranks() if r != info.rank]
        deadline = time.monotonic() + fail_fast.ABORT_GRACE_S + 2 * INCIDENT_GRACE_S + 1.0
        while True:
            outcomes = [board.outcome(r) for r in others]
            if "abort" in outcomes or time.monotonic() >= deadline:
                break
            if all(o == "failed" for o in outcomes):
                return
            time.sleep(0.02)
        self._aborted = {**doc, "missing": []}
        why = fail_fast.abort_process_group()
        print(f"reprokit: rank {info.rank} failed at step {doc.get('step')} and its peers end their part of the run: "
              + ("its process group is aborted too, so that its exit path does not wait for them" if why is None else
                 f"its process group could not be aborted ({why})"), file=sys.stderr, flush=True)

    def _verified(self, path: Path | None) -> str:
        """``path`` and whether its files are all there as its manifest says (sizes and headers: a window is never
        reported complete when it is not)."""
        if path is None:
            return "none could be written (see the warning above)"
        try:
            problems = verify(path, hash_tensors=False)
        except Exception as e:
            return f"{path} (could not verify: {e!r})"
        return f"{path} (verified)" if not problems else f"{path} ({len(problems)} problem(s): {problems[0]})"

    def _peer_failure(self, doc: dict[str, Any]) -> PeerFailure:
        """The error a rank that did not fail itself sees: who failed, where, and where every window is."""
        incident = self.out_dir / str(doc["incident"])
        aborted = self._aborted is not None and self.rank is not None and \
            fail_fast.abort_interrupts(self.rank.backend)
        missing = doc.get("missing") or []
        lost = f" Ranks {missing} wrote no window in time." if missing else ""
        if isinstance(doc.get("died"), dict):
            lost += (f" Rank {doc['died'].get('rank')} could write none (its process died): once the job has ended, "
                     f"`reprokit recover {shlex.quote(str(self.out_dir))}` writes it from its flight log.")
        how = "reprokit aborted the process group" if aborted else "reprokit ended this rank's part of the run"
        return PeerFailure(f"{how}: rank {doc.get('rank')} failed at step {doc.get('step')} ({doc.get('what')}); "
                           f"incident: {incident}.{lost} Replay every rank: `reprokit replay "
                           f"{shlex.quote(str(incident))}`. (on_incident=\"wait\" keeps this rank waiting instead.)",
                           incident=incident, failed_rank=doc.get("rank"), step=doc.get("step"))

    def _dump(self, failure: Failure, incident: str | None = None, from_watcher: bool = False) -> Path | None:
        """Write the window as a bundle; on any fault of ours warn and return None.

        After a sticky device error (the failure's kind, or a CUDA call here failing so), the bundle is written from
        host memory alone: see :meth:`_dump_dead`."""
        if failure.kind == FailureKind.DEVICE_ERROR or self._dead is not None:
            return self._dump_dead(failure, incident)
        ring = self._ring
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            try:
                if from_watcher:
                    ring = self._landed_window()  # the main thread may be stuck in a collective: never synchronize
                else:
                    for device in cuda_devices(self._devices(), torch.cuda.current_device()):
                        torch.cuda.synchronize(device)  # copies in flight must land before we read
                    self._engine.check(ordered=True)
            except Exception as e:
                if device_error.is_sticky(e):  # a later CUDA call failing the same way: the device died in the step
                    self._device_died(e)
                    return self._dump_dead(failure, incident)
                self._warn("", f"reprokit: {failure.describe()}, but the device failed ({e!r}); no bundle")
                return None
        if not self._window_ok or self._snapshot is None or self._engine.broken or self._engine.torn or not ring:
            self._warn("", f"reprokit: {failure.describe()}, but the recorded window is incomplete; no bundle")
            return None
        return self._write_bundle(failure, self._snapshot, ring, incident)

    def _write_bundle(self, failure: Failure, snap: _Snapshot, ring: list[_Step], incident: str | None,
                      host_only: bool = False) -> Path | None:
        """Write ``snap`` and ``ring`` as a bundle of ``failure`` (``host_only``: without a CUDA call)."""
        writer = None
        try:
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            where = self.out_dir / incident if incident else self.out_dir
            writer = BundleWriter(where, bundle_name(stamp, failure.step, failure.kind,
                                                     self.rank.tag if self.rank is not None else ""))
            path = self._write(writer, failure, ring, incident, snap=snap, host_only=host_only)
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

    def _read_devices(self) -> tuple[list[str] | None, bool]:
        """While the device works (at attach): the GPUs' names for env.json, and whether the CUDA generators' state
        can be written without a CUDA call (see :func:`reprokit.rng.cuda_state_on_host`). Also makes the model
        device's step marker. None / False where this process has no CUDA context."""
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None, False
        try:
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if self._model_device is not None:
                self._marks[self._model_device] = device_error.HostMarker(self._model_device)
            return names, host_format_matches(torch.cuda.current_device())
        except Exception:  # never a reason to refuse the run: a device error then writes what it can
            return None, False

    def _device_died(self, e: BaseException | str) -> None:
        """A CUDA call failed with a sticky error: from now on the recorder makes none (its own calls, that is), and
        its host buffers live to the end of the process (see :func:`reprokit.device_error.keep_to_exit`)."""
        if self._dead is None:
            self._dead = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            if self._marks or self._model_device is not None:
                device_error.keep_to_exit([self._engine.buffers(), list(self._slots.values()),
                                           list(self._spares.values()), list(self._marks.values())])

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
            "error": self._dead, "surfaced_at_step": surfaced, "rank": self.rank.rank if self.rank else None,
            "snapshot": "previous (the snapshot of the failing step had not landed)" if snap is not self._snapshot
            else "current"}}
        path = self._write_bundle(failure, snap, ring, incident, host_only=True)
        if path is not None:
            self._dead_bundle = path
            self.dead_write_seconds = time.perf_counter() - t0
        return path

    def _note_batch(self, batch: Any, record: _Step | None) -> Any:
        """The batch the failure note diagnoses: ``batch`` itself, or once the device died its host copy (the
        recorded step, decoded: the live batch's GPU tensors cannot be read any more)."""
        if self._dead is None:
            return batch
        if record is None:
            return None
        try:
            return pytree.decode(record.batch, record.tensors)
        except Exception:
            return None

    def _write(self, w: BundleWriter, failure: Failure, ring: list[_Step] | None = None,
               incident: str | None = None, snap: _Snapshot | None = None, host_only: bool = False) -> Path:
        snap = self._snapshot if snap is None else snap
        assert snap is not None
        ring = self._ring if ring is None else ring
        code = [] if self._root is None else [(relative(p, self._root), p)
                                              for p in snapshot_files(self._root, self._scripts)]
        run = self._run_doc(snap, failure, ring)
        if self.rank is not None:
            run["distributed"] = {**self.rank.to_json(), "incident": incident}
        env = capture_env(self._root, devices=self._device_names or []) if host_only else capture_env(self._root)
        steps = (r.record(host_only=host_only and self._host_rng) for r in ring)
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

    def _run_doc(self, snap: _Snapshot, failure: Failure, ring: list[_Step] | None = None) -> dict[str, Any]:
        ring = self._ring if ring is None else ring
        return {
            **self._run_base(),
            "window": {"start": snap.step, "end": ring[-1].step if ring else failure.step,
                       "steps": [r.step for r in ring]},
            "history": [{"step": s, "loss": loss, "grad_norm": g, "lr": lr, "loss_scale": scale}
                        for s, loss, g, lr, scale in self._history],
        }

    def _run_base(self) -> dict[str, Any]:
        """``run.json`` without the window and the history (what a flight log writes once, at attach)."""
        determinism, precision = split_flags(determinism_flags())
        device = next((str(p.device) for p in self.state.model.parameters()), "cpu")
        return {
            "refs": self._refs,
            "config": self._config,
            "recorder": {"snapshot_every": self.snapshot_every, "detect": self.settings.to_json(),
                         "memory": self.stats()},
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
        """Detach from the optimizer, stop the incident watcher and free the window."""
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
        self._slots.clear()
        self._spares.clear()
        self._kept = None
        self._bytes_at.clear()
        self._pool = {"pinned": 0, "pageable": 0}
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
