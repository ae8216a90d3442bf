"""The Recorder: watch every training step, keep a replayable window, dump it on failure.

Cost model: every step records the batch and the RNG state; every ``snapshot_every``
steps the full state is copied to host memory and the window restarts. On a
failure the window is written as a bundle. Faults of the recorder itself only
warn: it never changes training results and never raises its own errors into
the loop.

Batches: small CPU tensors are cloned at step start. Large CPU tensors are
referenced, and CUDA tensors are copied into reused pinned buffers on a side
stream, queued after the step function has returned (the host spends no time on
it before the forward launch, and neither the forward nor the loss read waits for
it; see :meth:`Recorder._after_step`); in both cases the tensor's version counter proves that the step did not
modify it in place (and, for referenced CPU tensors, that nothing refilled them
while they are in the window); if one did, that window is dropped and later
batches are copied up front.
"""

from __future__ import annotations

import datetime as _dt
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reprokit import bundle as B
from reprokit import pytree
from reprokit.code import ref_of, relative, snapshot_files
from reprokit.detect import DetectSettings, Monitor, Predicate
from reprokit.env import capture_env, determinism_flags
from reprokit.errors import CaptureError, RecorderWarning, TrainingFailure
from reprokit.signature import Failure
from reprokit.snapshot import SnapshotEngine
from reprokit.state import TrainState, capture_rng, capture_state

StepFn = Callable[[TrainState, Any], Any]


@dataclass
class _Snapshot:
    step: int
    tree: dict[str, Any]
    tensors: dict[str, torch.Tensor] | Path
    """In host memory, or the path of a safetensors file when spilling to disk."""


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
        batch_copy_bytes: CPU batch tensors smaller than this are copied; larger ones are
            referenced, and if one is modified in place while it is in the window (by its step,
            or by a loader refilling its buffers: its version counter moves) the window is
            dropped until the next snapshot and later batches are copied.

    Raises:
        CaptureError: at attach time, naming what cannot be recorded (a lambda as
            ``build``, a config that is not plain data, an optimizer state holding
            an unsupported object).

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
        batch_copy_bytes: int = 1 << 20,
    ):
        if snapshot_every < 1:
            raise CaptureError(f"snapshot_every must be >= 1, got {snapshot_every}")
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
        config_tree, config_tensors = pytree.encode(config, "config")
        if config_tensors:
            raise CaptureError(f"config holds tensors ({', '.join(config_tensors)}); pass plain data that build() "
                               "turns into tensors")
        self._config = config_tree
        capture_state(state, copy=lambda t: t)  # fail now, at attach time, if anything cannot be recorded
        self.monitor = Monitor(state, self.settings, detect)
        self._engine = SnapshotEngine(state, spill_dir)
        self.batch_copy_bytes = batch_copy_bytes
        self._referenced: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []
        """(batch tensor, its version at step start, pinned slot to copy it into after the step)."""
        self._window_refs: list[tuple[torch.Tensor, int]] = []
        """Large CPU batch tensors of the window, referenced, with their version when their step ended: a loader
        that refills its buffers in place would otherwise change the recorded batches after the fact."""
        self._copy_cuda_now = False
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        """Side streams for GPU batch copies; one entry marked in ``_marked`` once it waited for this step's batch."""
        self._marked: set[torch.device] = set()
        self._copy_marks: dict[torch.device, torch.cuda.Event] = {}
        self._flat_batch: tuple[list[str], dict[str, Any], list[str]] | None = None
        """(keys, encoded tree, tensor keys) of the last batch when it was a flat dict of tensors."""
        self._slots: dict[tuple[int, int], torch.Tensor | None] = {}
        self._slot = self._leaf = 0
        self.step_index = 0
        self.bundles: list[Path] = []
        self._snapshot: _Snapshot | None = None
        self._ring: list[B.StepRecord] = []
        self._window_ok = False
        self._history: deque[tuple[int, float | None, float | None]] = deque(maxlen=loss_history)
        self._warned: set[str] = set()

    # --- the hot path -----------------------------------------------------------

    def step(self, batch: Any) -> Any:
        """Run ``train_step(state, batch)`` under watch and return its loss.

        A loss tensor comes back detached from its autograd graph (backward has run; the
        graph is freed while the device finishes the step rather than after the loss read).

        Raises:
            The step's own exception, unchanged (a note names the bundle).
            TrainingFailure: when a detector fires; ``.bundle`` is the bundle path.
        """
        k = self.step_index
        record = self._record_step_start(k, batch)
        result = self.monitor.run(self.train_step, batch, k, after=self._after_step)
        self.step_index += 1
        if self._referenced or self._window_refs:
            self._check_referenced(k)
        if record is not None:
            record.loss, record.grad_norm = result.loss, result.grad_norm
        self._history.append((k, result.loss, result.grad_norm))
        if result.failure is None:
            return result.value
        path = self._dump(result.failure)
        if result.exc is not None:
            note = f"reprokit: bundle written to {path}" if path else "reprokit: no bundle could be written"
            if hasattr(result.exc, "add_note"):
                result.exc.add_note(note)
            raise result.exc
        raise TrainingFailure(result.failure, path)

    def _record_step_start(self, k: int, batch: Any) -> B.StepRecord | None:
        try:
            if self._snapshot is None or k - self._snapshot.step >= self.snapshot_every:
                self._take_snapshot(k)
            if not self._window_ok:
                return None
            self._referenced.clear()
            self._marked.clear()
            self._slot, self._leaf = k - self._snapshot.step if self._snapshot else 0, 0
            tree, tensors = self._encode_batch(batch)
            rng_tree, rng_tensors = capture_rng()
            rec = B.StepRecord(k, tree, {**tensors, **rng_tensors}, rng_tree)
            self._ring.append(rec)
            return rec
        except Exception as e:
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
        if t.requires_grad:
            t = t.detach()
        if t.is_cuda:
            # Pinned buffers per (slot in the window, leaf), reused window after window: no allocator calls.
            slot = self._slots.setdefault((self._slot, self._leaf), None)
            self._leaf += 1
            if slot is None or slot.shape != t.shape or slot.dtype != t.dtype:
                slot = self._slots[(self._slot, self._leaf - 1)] = torch.empty(t.shape, dtype=t.dtype,
                                                                               pin_memory=True)
            if self._copy_cuda_now:
                return slot.copy_(t, non_blocking=True)
            if t.device not in self._marked:  # the copy stream starts where the batch is ready
                self._marked.add(t.device)
                stream = self._copy_streams.get(t.device)
                if stream is None:
                    stream = self._copy_streams[t.device] = torch.cuda.Stream(device=t.device)
                mark = self._copy_marks.get(t.device)  # one event, reused: wait_stream() would create one a step
                if mark is None:
                    mark = self._copy_marks[t.device] = torch.cuda.Event()
                mark.record(torch.cuda.current_stream(t.device))
                stream.wait_event(mark)
            self._referenced.append((t, t._version, slot))  # copy queued in _after_step, on the copy stream
            return slot
        if t.numel() * t.element_size() < self.batch_copy_bytes:
            return t.clone(memory_format=torch.contiguous_format)  # small: a copy is cheaper than the risk
        self._referenced.append((t, t._version, None))  # large CPU tensor: keep a reference, check it after the step
        return t

    def _after_step(self) -> None:
        """The step function has just returned (or raised); the device is still working through it.

        Queue the deferred device-to-host batch copies, and when the next step takes a snapshot,
        walk the state for it now (see :meth:`SnapshotEngine.prepare`).

        GPU batch copies go on a side stream that waited, at step start, for the batch to be
        ready: they run beside the step's kernels, and the loss read does not wait behind
        them. ``record_stream`` keeps a batch the step frees from being reused before its copy
        lands; the training stream then waits for the copy stream (a device-side wait, the
        copies being long done by the time the step's last kernel runs), so a loader that
        refills its GPU buffer in place at the next step cannot overtake the copy.
        """
        snap = self._snapshot
        if snap is not None and self.step_index + 1 - snap.step >= self.snapshot_every:
            self._engine.prepare()
        try:
            for t, _, slot in self._referenced:
                if slot is not None:
                    stream = self._copy_streams[t.device]
                    with torch.cuda.stream(stream):
                        slot.copy_(t, non_blocking=True)
                    t.record_stream(stream)
            for dev in self._marked:
                torch.cuda.current_stream(dev).wait_stream(self._copy_streams[dev])
            self._marked.clear()
        except Exception as e:
            self._marked.clear()
            self._referenced.clear()
            self._drop_window("capture", f"reprokit: cannot copy step {self.step_index}'s batch ({e}); no bundle "
                                         "can be written until the next snapshot. Training continues.")

    def _check_referenced(self, k: int) -> None:
        changed = any(t._version != v for t, v, _ in self._referenced)
        refilled = any(t._version != v for t, v in self._window_refs)
        if not changed:
            self._window_refs += [(t, v) for t, v, slot in self._referenced if slot is None]
        self._referenced.clear()
        if changed or refilled:
            self.batch_copy_bytes = 1 << 62  # copy everything up front from now on
            self._copy_cuda_now = True
            what = (f"step {k} modified its batch in place" if changed else
                    f"a batch recorded earlier in the window was modified in place by step {k} (a loader that "
                    "refills its buffers?)")
            self._drop_window("inplace", f"reprokit: {what}; the recorded copy is lost, so no bundle until the next "
                                         f"snapshot (step {self._next_snapshot(k)}). Batches are copied from now on.")

    def _drop_window(self, key: str, message: str) -> None:
        """The window cannot be replayed any more: forget it until the next snapshot, and say so (once per key)."""
        self._window_ok = False
        self._ring.clear()
        self._window_refs.clear()
        self._warn(key, message)

    def _take_snapshot(self, k: int) -> None:
        self._ring.clear()
        self._window_refs.clear()
        self._snapshot = None  # free the old one before copying the new one
        self._window_ok = False
        tree, tensors = self._engine.take({"monitor": self.monitor.state_dict(), "step": k})
        self._snapshot = _Snapshot(k, tree, tensors)
        self._window_ok = True

    def _next_snapshot(self, k: int) -> int:
        start = self._snapshot.step if self._snapshot else k
        return start + self.snapshot_every * ((k - start) // self.snapshot_every + 1)

    # --- on failure ---------------------------------------------------------------

    def _dump(self, failure: Failure) -> Path | None:
        """Write the window as a bundle; on any fault of ours warn and return None."""
        if not self._window_ok or self._snapshot is None or self._engine.broken:
            self._warn("", f"reprokit: {failure.describe()}, but the recorded window is incomplete; no bundle")
            return None
        writer = None
        try:
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()  # pinned copies in flight must land before we read them
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            writer = B.BundleWriter(self.out_dir, f"bundle-{stamp}-step{failure.step:08d}-{failure.kind}")
            path = self._write(writer, failure)
        except Exception as e:
            if writer is not None:
                writer.abort()
            self._warn("", f"reprokit: could not write a bundle to {self.out_dir}: {e!r}. "
                               "Training's own error is raised as usual.")
            return None
        self.bundles.append(path)
        return path

    def _write(self, w: B.BundleWriter, failure: Failure) -> Path:
        snap = self._snapshot
        assert snap is not None
        code = [] if self._root is None else [(relative(p, self._root), p)
                                              for p in snapshot_files(self._root, self._scripts)]
        return B.write_bundle(w, failure=failure.to_json(), run=self._run_doc(snap, failure),
                              env=capture_env(self._root), state=(snap.tree, snap.tensors), steps=self._ring,
                              code=code)

    def _run_doc(self, snap: _Snapshot, failure: Failure) -> dict[str, Any]:
        device = next((str(p.device) for p in self.state.model.parameters()), "cpu")
        return {
            "refs": self._refs,
            "config": self._config,
            "recorder": {"snapshot_every": self.snapshot_every, "detect": self.settings.to_json()},
            "determinism": determinism_flags(),
            "device": device,
            "window": {"start": snap.step, "end": failure.step, "steps": [r.step for r in self._ring]},
            "history": [{"step": s, "loss": loss, "grad_norm": g} for s, loss, g in self._history],
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
            warnings.warn(message, RecorderWarning, stacklevel=3)

    def detach(self) -> None:
        """Stop watching (remove the optimizer hooks) but keep buffers, window and snapshot; see :meth:`attach`."""
        self.monitor.close()
        self._engine.detach()

    def attach(self) -> None:
        """Watch again after :meth:`detach` (say, after an evaluation loop that calls the optimizer)."""
        self.monitor.attach()
        self._engine.attach()

    def close(self) -> None:
        """Detach from the optimizer and free the window."""
        self.monitor.close()
        self._engine.close()
        self._ring.clear()
        self._snapshot = None

    @property
    def snapshot_stats(self) -> dict[str, Any]:
        """Bytes, pinned host bytes and host seconds of the last snapshot (for benchmarks)."""
        return dict(self._engine.stats)
