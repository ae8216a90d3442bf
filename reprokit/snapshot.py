"""Snapshots of training state at near-zero cost to the training loop.

CPU tensors are cloned. CUDA tensors are copied device-to-host on a side stream
into pinned buffers that are allocated once and reused by every later
snapshot, ordered after the training stream with an event. Parameters and
optimizer state only change inside ``optimizer.step()``, so an optimizer step
pre-hook makes the training stream wait (on the GPU, without blocking the host)
for the copy to finish before the first step that would overwrite them; the
forward and backward passes in between overlap with the copy. Other tensors
(module buffers such as BatchNorm statistics, ``TrainState.extra``) may change in
the forward pass, so they are first cloned on the device (small), then copied.

A copy of the whole state (~30 ms for GPT-2-124M with AdamW at ~55 GB/s) can
outlast the forward and backward it overlaps. So the helper thread issues the
copies in chunks and keeps only a few in flight; when the optimizer is about to
step, the pre-hook stops it, issues the rest itself and makes the optimizer wait
(on the GPU) for the copy to end. Measured on GPT-2-124M (H200, every snapshot
step timed): the snapshot step takes ~4 ms longer than
the others. ``stage_on_device=True`` instead clones what is left on the device
(from memory the caching allocator already holds) so that the optimizer waits
only for the chunks in flight; it is off by default because cloning several
hundred tensors one by one costs ~5 ms of host time in the pre-hook, more than
the wait it saves (+7.5-11 ms on the same step).

With ``spill_dir`` the state streams through a bounded pinned staging buffer
into a safetensors file on local disk instead of staying in host memory, for
states that do not fit in RAM; that copy is synchronous and its cost is
measured by ``bench/recorder_overhead.py``.
"""

from __future__ import annotations

import os
import queue
import shutil
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from reprokit.bundle.tensorfile import WrittenFile, parallelism, shard, write_safetensors
from reprokit.device_error import is_sticky
from reprokit.errors import RecorderWarning
from reprokit.state import TrainState, capture_rng, capture_state

_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types whose data pointer is read (a DTensor has no storage of its own)."""


def _need(layout: list[tuple[str, torch.Tensor, Any]]) -> int:
    """Host bytes a snapshot of ``layout`` takes (tied tensors once)."""
    return sum(t.numel() * t.element_size() for _, t, how in layout if how != "same")


class SnapshotEngine:
    """Takes snapshots for one Recorder. ``take()`` returns ``(tree, tensors_or_spill_path)``."""

    def __init__(self, state: TrainState, spill_dir: str | Path | None = None, staging_bytes: int = 256 << 20,
                 chunk_bytes: int = 32 << 20, chunks_in_flight: int = 4, stage_on_device: bool = False,
                 sync: bool = False, limit: int | None = None, fallback_spill_dir: str | Path | None = None,
                 keep_previous: bool = True):
        self.state = state
        self.keep_previous = keep_previous
        """Copy CUDA state into two sets of host buffers, in turn, where twice the state fits the budget: the last
        complete snapshot stays intact while the next one copies (a device error that strikes then leaves it
        usable). Otherwise one set, overwritten by each snapshot."""
        self.previous_kept = False
        """The last :meth:`take` copied into the other set of buffers: the snapshot before it is still intact."""
        self.serial = 0
        """Counts :meth:`take`; a snapshot's number, for :meth:`complete`."""
        self._async: set[int] = set()
        """Serials whose CUDA copies were queued asynchronously: complete once their marker has landed."""
        self._marker: Any = None
        """A :class:`reprokit.device_error.HostMarker` written on the copy stream after each snapshot's last copy."""
        self.limit = limit
        """Host bytes an in-memory snapshot may hold; a bigger state spills to ``fallback_spill_dir``."""
        self.fallback_spill_dir = Path(fallback_spill_dir) if fallback_spill_dir else None
        self.others: Any = None
        """Optional ``(make_room: bool) -> bytes``: the room its owner's budget leaves for the snapshot (with
        ``make_room``, after freeing buffers it no longer needs)."""
        self.spilled_for_memory: str | None = None
        """Why snapshots went to disk instead of host memory (set once, when it happens)."""
        self.sync = sync
        """Copy CUDA state on the training stream: nothing can race the copy, at the cost of a stall."""
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self.staging_bytes = staging_bytes
        self.chunk_bytes = chunk_bytes
        self.chunks_in_flight = chunks_in_flight
        self.stage_on_device = stage_on_device
        self._banks: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        """Host buffers per state key, two sets (see ``keep_previous``); ``_buffers`` is the one the next take uses."""
        self._cur = 0
        self._swapped = False
        """The last take turned to the other set: the snapshot it took stays intact through the next take."""
        self._stream: Any = None
        self._done: Any = None
        self._staging: torch.Tensor | None = None
        self._spilled: Path | None = None  # the folder of the last snapshot spilled to disk
        self._spills = 0
        self._thread: threading.Thread | None = None
        self._thread_error: BaseException | None = None
        self._stop = threading.Event()
        self._plan: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        self._prepared: tuple[tuple, tuple[dict[str, Any], list[tuple[str, torch.Tensor, Any]]]] | None = None
        self._pinning: threading.Thread | None = None  # allocates missing pinned buffers off the training thread
        self._pinned: dict[tuple[int, str], torch.Tensor] = {}  # what it allocated (per set), adopted once done
        self._pin_error: BaseException | None = None
        self._reserved = 0
        """Bytes the pinning thread is allocating: counted as pinned from its start (the budget sees them at once)."""
        self._issued = 0
        """How many plan entries the helper thread has issued (it advances them chunk by chunk)."""
        self._issued_event: Any = None
        """Recorded on the side stream after the last issued copy."""
        self.broken = False
        """The last snapshot's copies failed: it must not be written."""
        self._watched: list[tuple[str, torch.Tensor, int]] = []
        """(key, tensor, version at take) of tensors copied from the live tensor, asynchronously: until the copy is
        known to be ordered before any later write, an in-place write to one of them would tear the snapshot."""
        self._volatile: set[str] = set()
        """Keys of parameters / optimizer state seen written outside ``optimizer.step()``: cloned on the device."""
        self.torn: str | None = None
        """Why the last snapshot cannot be trusted (a watched tensor was written while its copy was in flight)."""
        self._hook: Any = state.optimizer.register_step_pre_hook(self._before_optimizer_step)
        self.stats: dict[str, Any] = {"snapshots": 0, "bytes": 0, "pinned_bytes": 0, "pageable_bytes": 0,
                                      "host_seconds": 0.0,
                                      "spill_seconds": 0.0, "staged_bytes": 0, "waited_for_copy": False,
                                      "prepared": False}

    @property
    def _buffers(self) -> dict[str, torch.Tensor]:
        """The set of host buffers the next snapshot copies into."""
        return self._banks[self._cur]

    @property
    def stream(self) -> Any:
        """The side stream snapshot copies run on (``None`` until a CUDA snapshot is taken without ``sync``)."""
        return self._stream

    # --- ordering ----------------------------------------------------------------

    def _join(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._thread_error is not None:
            err, self._thread_error = self._thread_error, None
            raise RuntimeError(f"snapshot copy failed: {err!r}") from err

    def _before_optimizer_step(self, *_: Any) -> None:
        if self._thread is None and not self._plan:
            return  # no snapshot in flight (every step but the one after a snapshot)
        try:
            self._stop.set()
            self._join()  # it stops after the chunk it is issuing
            rest = self._plan[self._issued:]
            if rest:
                self._finish(rest)
            if self._issued_event is not None and not self._issued_event.query():
                # A GPU-side wait for the copies in flight; the host goes on.
                torch.cuda.current_stream().wait_event(self._issued_event)
            self._plan = []
            self.check(ordered=True)  # every later write on this stream now runs after the copies
        except Exception as e:  # never break the user's optimizer step
            self.broken = True
            self._plan = []
            if not is_sticky(e):  # a dead device: the step fails with that error itself, and the bundle says it
                warnings.warn(f"reprokit: snapshot failed ({e}); no bundle until the next snapshot", RecorderWarning,
                              stacklevel=2)

    def _finish(self, rest: list[tuple[torch.Tensor, torch.Tensor, bool]]) -> None:
        """Copy what the helper thread had not issued yet, from device clones when memory allows."""
        need = sum(src.numel() * src.element_size() for _, src, owned in rest if not owned)
        staged = self.stage_on_device and need <= _free_cached_bytes() // 2
        if staged:
            try:
                with torch.no_grad():
                    rest = [(buf, src if owned else src.clone(), True) for buf, src, owned in rest]
            except torch.cuda.OutOfMemoryError:  # fragmented cache: wait for the copy instead
                staged = False
            else:
                cloned = torch.cuda.Event()
                cloned.record(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            if staged:
                self._stream.wait_event(cloned)
            for buf, src, owned in rest:
                buf.copy_(src, non_blocking=True)
                if owned:
                    src.record_stream(self._stream)
            self._mark_complete()
            self._done.record(self._stream)
        if not staged:
            self._issued_event = self._done
        self.stats["staged_bytes"] = need if staged else 0
        self.stats["waited_for_copy"] = not staged

    def wait(self) -> None:
        """Block until the last snapshot's copies have landed in host memory."""
        self._join()
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        self.check(ordered=True)

    def copies_landed(self) -> bool:
        """Whether the last snapshot's copies are all in host memory, asked without waiting and without a CUDA call (a
        thread other than the training one may ask while the training stream is stuck, or the context is dead)."""
        return self.complete(self.serial)

    def complete(self, serial: int) -> bool:
        """Whether snapshot ``serial``'s copies are all in host memory: taken synchronously (CPU state, spilled,
        ``sync`` after its wait), or its marker has landed. Reads host memory only (see
        :class:`reprokit.device_error.HostMarker`): safe after a sticky device error."""
        if serial not in self._async:
            return True
        return self._marker is not None and self._marker.landed(serial)

    def _two_banks(self, need: int) -> bool:
        """Whether snapshots of ``need`` bytes go into two sets of buffers in turn (see ``keep_previous``)."""
        return self.keep_previous and not self.sync and self.spill_dir is None and 2 * need <= self._room()

    def _turn_banks(self, two: bool) -> None:
        """After a take: the next one copies into the other set of buffers (``two``), leaving this one intact; or
        into this set again, and the other set is freed (a snapshot still using it keeps its own references)."""
        self._swapped = two
        if two:
            self._cur = 1 - self._cur
            return
        other = self._banks[1 - self._cur]
        for key in list(other):
            self._account(other.pop(key), -1)

    def _ensure_marker(self) -> None:
        """Make the marker on the training thread (its table is ready for the copy stream: see HostMarker)."""
        if self._marker is None:
            from reprokit.device_error import HostMarker

            self._marker = HostMarker(torch.device("cuda", torch.cuda.current_device()))

    def _mark_complete(self) -> None:
        """On the stream of the snapshot's copies, after the last one: its marker (see :meth:`complete`)."""
        self._ensure_marker()
        self._marker.mark(self.serial)

    def check(self, ordered: bool = False) -> None:
        """Was a tensor copied asynchronously written in place since the snapshot was taken?

        The copies read parameters and optimizer state straight from the live tensors, which is
        sound only while nothing writes them before the copy is done: ``optimizer.step()`` is
        held back by the pre-hook, but a forward that renormalises a weight in place
        (``nn.Embedding(max_norm=...)``), a weight clamp or an EMA written into the model would
        race the copy. Every in-place torch op bumps the tensor's version counter, so a moved
        counter marks the snapshot torn (the recorder then takes a new one at the next step,
        cloning those tensors on the device first, in stream order). A write that bypasses the
        counter (``p.data.copy_(...)``, a custom kernel) cannot be seen: such loops should run
        with ``snapshot_sync=True``.

        Args:
            ordered: the copies are done, or every later write is ordered after them on the
                device: once counters are unchanged here, the snapshot is safe and the
                watch ends. Otherwise the watch goes on until the copy event has completed.
        """
        if not self._watched:
            return
        moved = [key for key, t, v in self._watched if t._version != v]
        if moved:
            self._watched = []
            self._volatile.update(moved)
            self.torn = (f"{len(moved)} tensor(s) ({', '.join(moved[:3])}{', ...' if len(moved) > 3 else ''}) were "
                         "written outside optimizer.step() while the snapshot copied them")
            return
        thread = self._thread
        if ordered or (thread is not None and not thread.is_alive() and self._issued == len(self._plan)
                       and self.complete(self.serial)):
            self._watched = []  # ``done`` is recorded only once every copy is issued: before that, query() says nothing

    @property
    def keeps_last(self) -> bool:
        """The last take turned to the other set of buffers: the next take leaves that snapshot intact."""
        return self._swapped

    @property
    def last_buffers(self) -> dict[str, torch.Tensor]:
        """The set of host buffers the last take copied into (``_buffers`` is the next one's)."""
        return self._banks[1 - self._cur] if self._swapped else self._buffers

    def buffers(self) -> list[Any]:
        """Everything the engine holds that a CUDA copy used: both sets of host buffers, the spill staging buffer, the
        marker, the device clones of a copy in flight (see :func:`reprokit.device_error.keep_to_exit`)."""
        return [dict(self._banks[0]), dict(self._banks[1]), self._staging, self._marker, list(self._plan),
                dict(self._pinned)]

    def abandon(self) -> None:
        """The CUDA context is dead (a sticky device error): stop without a CUDA call (the optimizer hook removed, no
        wait for a copy); the caller keeps :meth:`buffers` alive."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._stop.set()
        self._plan, self._prepared = [], None

    def detach(self) -> None:
        """Remove the optimizer hook; a snapshot in flight is finished first (the hook guards it)."""
        if self._hook is not None:
            try:
                self.wait()
            except Exception as e:
                self.broken = True
                warnings.warn(f"reprokit: snapshot failed ({e})", RecorderWarning, stacklevel=2)
            self._hook.remove()
            self._hook = None

    def attach(self) -> None:
        if self._hook is None:
            self._hook = self.state.optimizer.register_step_pre_hook(self._before_optimizer_step)

    def close(self) -> None:
        self.detach()
        self.wait()
        self._collect_pinned()
        for bank in self._banks:
            bank.clear()
        self._staging = None
        self.stats["pinned_bytes"] = self.stats["pageable_bytes"] = 0
        if self._spilled is not None:
            shutil.rmtree(self._spilled, ignore_errors=True)
            self._spilled = None

    # --- taking ------------------------------------------------------------------------

    def take(self, extra_tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor] | list[WrittenFile]]:
        t0 = time.perf_counter()
        self.serial += 1
        self.previous_kept = False
        if self.spill_dir is not None:
            out: tuple[dict[str, Any], dict[str, torch.Tensor] | list[WrittenFile]] = self._spill(extra_tree)
        else:
            out = self._in_memory(extra_tree)
        self.stats["snapshots"] += 1
        self.stats["host_seconds"] = time.perf_counter() - t0
        return out

    def prepare(self) -> None:
        """Walk the state for the next :meth:`take` now, while the device is still busy with the step.

        The recorder calls this right after the step function returns, when the next step is
        due for a snapshot: the walk (~1,000 state-dict entries for GPT-2 with AdamW, a few ms
        of Python) then overlaps with the GPU finishing the step instead of idling it at the
        start of the next one. Sound because training state changes only inside the step
        function (the replay contract); a cheap fingerprint taken again in ``take()`` (learning
        rates, train/eval mode, how much optimizer state exists) catches a loop that edits the
        state between steps, and then the walk is redone.
        """
        if self.spill_dir is not None or self._stream is None:
            return  # CPU state is cloned in take(); nothing to overlap with
        try:
            self._collect_pinned()  # a thread pinning buffers for this snapshot: wait for it (it had the window)
            self._prepared = (self._fingerprint(), self._walk())
        except Exception:
            self._prepared = None  # take() walks again and reports any error there

    def discard_prepared(self) -> None:
        """The step after :meth:`prepare` took no snapshot (it was skipped): a later one must walk afresh."""
        self._prepared = None

    def _fingerprint(self) -> tuple:
        """What a loop may change between steps that the prepared walk took as it was: modes, which parameters train,
        a parameter or buffer given new data (a cast), learning rates, how much optimizer state exists."""
        opt, model = self.state.optimizer, self.state.model
        return (model.training, tuple(m.training for m in model.modules()),
                tuple((id(t), t.dtype, t.requires_grad,
                       t.data_ptr() if type(t) in _PLAIN and t.layout is torch.strided else None)
                      for t in (*model.parameters(), *model.buffers())), len(opt.state),
                tuple(tuple(sorted((k, v) for k, v in g.items() if isinstance(v, (int, float, bool))))
                      for g in opt.param_groups),
                None if self.state.scheduler is None else getattr(self.state.scheduler, "last_epoch", None),
                len(self.state.extra), tuple(id(p.grad) for p in self.state.model.parameters()))

    def pin_ahead(self) -> None:
        """Pin the host buffers of the state as it is now, before training starts (the Recorder calls this when it is
        made), so that the first snapshot's copies do not wait for the CUDA driver to pin memory at step 0."""
        missing = self._pin_plan()
        if missing:
            self._pin(missing)
            self._adopt_pinned()

    def pin_aside(self) -> bool:
        """Pin the buffers of state that appeared since (AdamW's moments, after the first step) on a helper thread.

        Pinning host memory costs the CUDA driver about 0.3 s per GB. The recorder calls this when the optimizer's
        state grows; by the next snapshot (``snapshot_every`` steps later) the buffers are there, and a snapshot
        that comes first waits for the thread (:meth:`_in_memory`), so snapshot steps never move. The bytes being
        pinned count against the budget from the start (:attr:`held_bytes`, the peaks). False where a thread
        still runs (the caller asks again later).
        """
        if self._pinning is not None and self._pinning.is_alive():
            return False
        self._collect_pinned()
        missing = self._pin_plan()
        if missing:
            self._reserved = sum(t.numel() * t.element_size() for _, _, t in missing)
            self.stats["pinned_bytes"] += self._reserved
            self._pinning = threading.Thread(target=self._pin, args=(missing,), name="reprokit-pin", daemon=True)
            self._pinning.start()
        return True

    def _collect_pinned(self) -> None:
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None
            self._adopt_pinned()

    def _pin_plan(self) -> list[tuple[int, str, torch.Tensor]]:
        """``(set, key, tensor)`` of the state's CUDA tensors that lack a pinned buffer, in the set the next take
        uses and, where snapshots alternate between two (``keep_previous``), in the other; none where pinning ahead
        does not apply (no CUDA, spilling, synchronous copies, a state larger than the budget's room, a walk that
        fails: take() handles those as before)."""
        if self.spill_dir is not None or self.sync or not torch.cuda.is_available():
            return []
        try:
            walked = self._walk(allocate=False)
        except Exception:
            return []  # take() walks again and reports the error
        need = _need(walked[1])
        if self.limit is not None and need > self._room():
            return []  # take() makes room or spills, as before
        banks = [self._cur, 1 - self._cur] if self._two_banks(need) else [self._cur]
        return [(bank, key, t) for bank in banks for key, t in self._missing(walked[1], self._banks[bank])]

    @staticmethod
    def _missing(layout: list[tuple[str, torch.Tensor, Any]],
                 bank: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """The CUDA tensors without a buffer in ``bank`` yet, tied ones once (the walk lists the others as "same")."""
        out, seen = [], set()
        for key, t, how in layout:
            if how in ("cpu", "same"):
                continue
            ident = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            buf = bank.get(key)
            if ident not in seen and (buf is None or buf.shape != t.shape or buf.dtype != t.dtype):
                out.append((key, t))
            seen.add(ident)
        return out

    def _pin(self, missing: list[tuple[int, str, torch.Tensor]]) -> None:
        """Allocate pinned buffers like ``missing``'s tensors (run on a helper thread; torch.empty releases the GIL)."""
        try:
            for bank, key, t in missing:
                self._pinned[(bank, key)] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        except Exception as e:  # said when adopted: take() then allocates what is still missing
            self._pin_error = e

    def _adopt_pinned(self) -> None:
        self.stats["pinned_bytes"] -= self._reserved  # the buffers themselves are counted instead
        self._reserved = 0
        for (bank, key), buf in self._pinned.items():
            old = self._banks[bank].get(key)
            if old is not None:
                self._account(old, -1)
            self._banks[bank][key] = buf
            self._account(buf, 1)
        self._pinned = {}
        error, self._pin_error = self._pin_error, None
        if error is not None:
            message = f"reprokit: pinning snapshot buffers in the background failed ({error!r}); the snapshot " \
                      "allocates them itself"
            try:
                warnings.warn(message, RecorderWarning, stacklevel=3)
            except Exception:  # warnings turned into errors: still never raise into the training loop
                print(message, file=sys.stderr)

    def _walk(self, allocate: bool = True) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor, Any]]]:
        """The state's tree (references, no copies) and what to do with each tensor: a CPU clone, the
        pinned buffer of an identical tensor already listed (tied weights), or a copy into a pinned buffer
        (without ``allocate``: None where that buffer does not exist yet)."""
        tree, refs = capture_state(self.state, copy=lambda t: t.detach())
        protected = self._protected() if any(t.is_cuda for t in refs.values()) else set()
        layout: list[tuple[str, torch.Tensor, Any]] = []
        seen: dict[tuple, torch.Tensor] = {}
        for key, t in refs.items():
            if not t.is_cuda:
                layout.append((key, t, "cpu"))
                continue
            ident = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
            if ident in seen:  # tied weights: one copy (the bundle writer un-shares them)
                layout.append((key, seen[ident], "same"))
                continue
            if not allocate and not self._has_buffer(key, t):
                seen[ident] = t  # a tied tensor listed after it is "same": counted and pinned once
                layout.append((key, t, None))
                continue
            buf = seen[ident] = self._buffer(key, t)
            layout.append((key, t, (buf, t.data_ptr() not in protected or key in self._volatile)))
        return tree, layout

    def _in_memory(self, extra_tree: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor] | list[WrittenFile]]:
        """Take the walk (prepared during the last step, or now); issue the copies from a thread.

        Device clones of unprotected tensors happen here; launching hundreds of device-to-host
        copies is left to a helper thread so the training thread goes on launching the next
        forward. The optimizer pre-hook stops that thread before the parameters change.
        """
        self.wait()  # the buffers are about to be reused
        self._collect_pinned()  # buffers being pinned aside (an early snapshot came first): wait for them
        self._async.intersection_update({self.serial - 1})  # complete once waited for: only the last one matters
        self.previous_kept = self._swapped and bool(self._banks[1 - self._cur])
        self.broken = False
        self.torn = None
        prepared, self._prepared = self._prepared, None
        walked = prepared[1] if prepared is not None and prepared[0] == self._fingerprint() else self._walk()
        self.stats["prepared"] = prepared is not None and walked is prepared[1]
        tree, layout = walked
        rng_tree, rng_tensors = capture_rng(self.state.extra)
        tensors: dict[str, torch.Tensor] = {}
        plan: list[tuple[torch.Tensor, torch.Tensor, bool]] = []
        cuda = False
        need = _need(layout)
        if self.limit is not None and self.fallback_spill_dir is not None and need > self._room() and \
                need > self._room(make_room=True):
            self._spill_from_now_on(need)
            return self._spill(extra_tree)
        for key, t, how in layout:
            if how == "cpu":
                tensors[key] = self._buffer(key, t).copy_(t)
            elif how == "same":
                tensors[key] = t
            else:
                buf, owned = how
                owned = (owned or key in self._volatile) and not self.sync  # synchronous copies need no clone
                # Module buffers and extra state may change in the next forward: clone them on the device now.
                plan.append((buf, t.clone() if owned else t, owned))
                if not owned and not self.sync:
                    self._watched.append((key, t, t._version))
                tensors[key] = buf
                cuda = True
        for key in [key for key in self._buffers if key not in tensors]:  # state that is gone (grads, say)
            self._account(self._buffers.pop(key), -1)
        if cuda:
            self._async.add(self.serial)
            self._ensure_marker()
        if cuda and self.sync:
            for buf, src, _ in plan:
                buf.copy_(src, non_blocking=True)  # on the training stream: ordered before every later write
            self._mark_complete()
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream())
            self._watched = []
        elif cuda and self._stream is None:
            self._stream = torch.cuda.Stream()
        if cuda and not self.sync:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream())
            self._done = torch.cuda.Event()
            self._plan, self._issued, self._issued_event = plan, 0, None
            self._stop.clear()
            self.stats["staged_bytes"], self.stats["waited_for_copy"] = 0, False
            device = torch.cuda.current_device()
            self._thread = threading.Thread(target=self._issue, args=(plan, ready, self._done, device),
                                            name="reprokit-snapshot", daemon=True)
            self._thread.start()
        self._turn_banks(cuda and self._two_banks(need))
        self.stats["bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"state": tree, "rng": rng_tree, **extra_tree}, {**tensors, **rng_tensors}

    def _issue(self, plan: list[tuple[torch.Tensor, torch.Tensor, bool]], ready: Any, done: Any, device: int) -> None:
        """Issue the copies chunk by chunk, a few chunks in flight, until done or told to stop."""
        in_flight: list[Any] = []
        try:
            with torch.cuda.device(device), torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                i = 0
                while i < len(plan) and not self._stop.is_set():
                    nbytes = 0
                    while i < len(plan) and nbytes < self.chunk_bytes:
                        buf, src, owned = plan[i]
                        buf.copy_(src, non_blocking=True)
                        if owned:
                            src.record_stream(self._stream)
                        nbytes += buf.numel() * buf.element_size()
                        i += 1
                    event = torch.cuda.Event()
                    event.record(self._stream)
                    self._issued, self._issued_event = i, event
                    in_flight.append(event)
                    if len(in_flight) > self.chunks_in_flight:
                        in_flight.pop(0).synchronize()  # releases the GIL; about one chunk's copy time
                if i == len(plan):
                    self._mark_complete()
                    done.record(self._stream)
        except Exception as e:  # surfaced by wait()/the hook, never lost
            self._thread_error = e
            self._issued = len(plan)
            try:
                done.record(torch.cuda.current_stream(device))
            except Exception:  # a dead context (a sticky device error): the hook's own calls fail the same way
                pass

    def _protected(self) -> set[int]:
        """Data pointers that only ``optimizer.step()`` writes to: parameters and optimizer state."""
        ptrs = {p.data_ptr() for p in self.state.model.parameters()}
        for st in self.state.optimizer.state.values():
            ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
        return ptrs

    def _has_buffer(self, key: str, t: torch.Tensor) -> bool:
        buf = self._buffers.get(key)
        return buf is not None and buf.shape == t.shape and buf.dtype == t.dtype

    def _buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        """The host buffer snapshot after snapshot copies ``t`` into: pinned for a CUDA tensor, pageable for a CPU one.

        Keyed by name: optimizer state created after the first snapshot does not shift the others.
        """
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            if buf is not None:
                self._account(buf, -1)
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[key] = buf
            self._account(buf, 1)
        return buf

    def _account(self, buf: torch.Tensor, sign: int) -> None:
        self.stats["pinned_bytes" if buf.is_pinned() else "pageable_bytes"] += sign * buf.numel() * buf.element_size()

    @property
    def held_bytes(self) -> int:
        """Host memory the engine holds now: snapshot buffers and the spill staging buffer."""
        return int(self.stats["pinned_bytes"] + self.stats["pageable_bytes"])

    def _room(self, make_room: bool = False) -> int:
        """Bytes an in-memory snapshot may take: ``limit``, or less where the owner's budget leaves less (with
        ``make_room``, after the owner freed what it can)."""
        if self.limit is None:
            return 1 << 62
        return self.limit if self.others is None else min(self.limit, self.others(make_room))

    def _spill_from_now_on(self, need: int) -> None:
        """The state does not fit the host-memory budget: free the buffers and stream snapshots to disk instead."""
        assert self.fallback_spill_dir is not None
        self.spill_dir = self.fallback_spill_dir
        self.spilled_for_memory = (f"the state ({mib(need)}) does not fit the recorder's host-memory budget "
                                   f"for snapshots ({mib(self._room())}); snapshots are written to "
                                   f"{self.spill_dir} instead (a synchronous copy at every snapshot)")
        for bank in self._banks:
            bank.clear()
        self.stats["pinned_bytes"] = self.stats["pageable_bytes"] = 0
        self.staging_bytes = max(64 << 10, min(self.staging_bytes, self._room() // 4))

    # --- spilling to disk ----------------------------------------------------------------

    def _spill(self, extra_tree: dict[str, Any]) -> tuple[dict[str, Any], list[WrittenFile]]:
        """Stream the state through a bounded staging buffer into safetensors files (the bundle's parts, written
        several at once); returns them with their sha256, computed as they were written: a dump links the files
        into the bundle without reading them again."""
        assert self.spill_dir is not None
        t0 = time.perf_counter()
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        tree, tensors = capture_state(self.state, copy=lambda t: t.detach())  # references, no copies
        rng_tree, rng_tensors = capture_rng(self.state.extra)
        tensors = {**tensors, **rng_tensors}
        self._spills += 1
        folder = self.spill_dir / f"{self._spill_stem()}-{self._spills}"
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        parts = shard(tensors)
        workers = parallelism(len(parts))
        chunk = max(64 << 10, self.staging_bytes // workers)  # one slice of the staging buffer per writer
        staging = self._staging_for(workers * chunk) if any(t.is_cuda for t in tensors.values()) else None

        slices: queue.SimpleQueue[int] = queue.SimpleQueue()  # a writer takes a slice, and gives it back when done
        for w in range(workers):
            slices.put(w * chunk)

        def write(i: int) -> WrittenFile:
            at = slices.get()
            try:
                path = tmp / f"part-{i}.safetensors"
                sha, size = write_safetensors(path, parts[i], chunk=chunk,
                                              staging=None if staging is None else lambda n: staging[at:at + n])
            finally:
                slices.put(at)
            return WrittenFile(folder / path.name, sha, size)

        # The parts are copied from the device on the writers' threads, whose current stream is not the training
        # stream: wait here for everything queued on the state's devices (the spill is synchronous anyway).
        for device in {t.device for t in tensors.values() if t.is_cuda}:
            torch.cuda.synchronize(device)
        try:
            with ThreadPoolExecutor(workers, thread_name_prefix="reprokit-spill") as pool:
                written = list(pool.map(write, range(len(parts))))
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a failed spill (disk full) leaves no partial parts behind
            raise
        if self._spilled is not None:
            shutil.rmtree(self._spilled, ignore_errors=True)  # the previous snapshot (a bundle holds links of its own)
        self._spilled = folder
        self.stats["bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
        self.stats["spill_seconds"] = time.perf_counter() - t0
        return {"state": tree, "rng": rng_tree, **extra_tree}, written

    def _spill_stem(self) -> str:
        return f"snapshot-{os.getpid()}-{id(self)}"

    def _staging_for(self, n: int) -> torch.Tensor:
        if self._staging is not None and self._staging.numel() < n:
            self._account(self._staging, -1)
            self._staging = None
        if self._staging is None:
            self._staging = torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self._account(self._staging, 1)
        return self._staging[:n]


def mib(n: int) -> str:
    """Bytes for people: whole MiB when large, two decimals below 10 MiB."""
    return f"{n / 2**20:.0f} MiB" if n >= 10 << 20 else f"{n / 2**20:.2f} MiB"


def _free_cached_bytes() -> int:
    """Device memory the caching allocator holds but nothing uses (what a clone can take without cudaMalloc)."""
    stats = torch.cuda.memory_stats_as_nested_dict()
    return int(stats["reserved_bytes"]["all"]["current"] - stats["allocated_bytes"]["all"]["current"])
