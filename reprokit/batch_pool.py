"""The host buffers a Recorder copies each step's batch into, reused window after window.

A window of ``snapshot_every`` steps holds one batch per step. Each tensor leaf of a step's batch is copied into the
buffer at (its position in the window, its leaf number): the buffer is reused whenever a step at that position has a
leaf of the same shape and dtype, so in steady state recording allocates nothing (a fresh large buffer costs its page
faults every step). A CUDA tensor's buffer is pinned, and the copy is queued on the tensor's training stream with
``non_blocking`` (the host goes on; the step's kernels, and any later refill of the batch, are ordered after it).

While the previous window is kept (its snapshot's successor may still be copying: see ``Recorder._keep_window``), a
buffer one of its steps still holds is never written: a spare takes its place (:meth:`BatchPool.copy`).

The pool counts its bytes (pinned and pageable, and per position) for the Recorder's host-memory budget; the budget's
decisions (what fits, what to free) stay with the Recorder.
"""

from __future__ import annotations

from typing import Any

import torch

from reprokit import pytree

Key = tuple[int, int]
"""(position in the window, leaf number within the step's batch)."""


class BatchPool:
    """The batch buffers of one Recorder and their byte counts.

    Example:
        >>> pool = BatchPool()
        >>> pool.start(position=0, kept_steps=0)
        >>> tree, tensors = pool.encode({"x": torch.ones(2, 3)})
        >>> pool.bytes()
        24
    """

    def __init__(self) -> None:
        self.slots: dict[Key, torch.Tensor] = {}
        """The buffers in use, per (position, leaf)."""
        self.spares: dict[Key, torch.Tensor] = {}
        """Buffers swapped out of :attr:`slots` while the kept window's steps still use them."""
        self.copied: set[torch.device] = set()
        """CUDA devices this step's batch tensors were copied from (device to host, on their training streams)."""
        self.pinned = 0
        """Bytes of the pinned buffers, in use and spare."""
        self.pageable = 0
        """Bytes of the pageable buffers, in use and spare."""
        self._at: dict[int, int] = {}
        self._position = self._leaf = 0
        self._kept_steps = 0
        self._flat: tuple[list[str], dict[str, Any], list[str]] | None = None
        """(keys, encoded tree, tensor keys) of the last batch when it was a flat dict of tensors."""

    # --- one step's batch ----------------------------------------------------------------

    def start(self, position: int, kept_steps: int) -> None:
        """The next :meth:`encode` is the batch of the step at ``position`` of the window; the first ``kept_steps``
        positions' buffers belong to the kept window (never written: spares take their place)."""
        self._position, self._leaf, self._kept_steps = position, 0, kept_steps
        self.copied.clear()

    def encode(self, batch: Any) -> tuple[Any, dict[str, torch.Tensor]]:
        """``pytree.encode(batch, "batch", copy=self.copy)``; a dict of dense tensors with last step's keys reuses
        last step's tree (most loops feed the same dict every step)."""
        flat = self._flat
        if flat is not None and type(batch) is dict and len(batch) == len(flat[0]) and all(
                k is f or k == f for k, f in zip(batch, flat[0])):
            values = batch.values()
            if all(type(v) is torch.Tensor and v.layout is torch.strided for v in values):
                return flat[1], {key: self.copy(v) for key, v in zip(flat[2], values)}
        tree, tensors = pytree.encode(batch, "batch", copy=self.copy)
        flat_keys = [f"batch/{k}" for k in batch] if type(batch) is dict else []
        self._flat = None
        if flat_keys and all(type(k) is str for k in batch) and tree == {
                k: {pytree.TENSOR: key} for k, key in zip(batch, flat_keys)} and list(tensors) == flat_keys:
            self._flat = (list(batch), tree, flat_keys)
        return tree, tensors

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` as it is now, in the buffer of the next leaf.

        A CPU tensor is copied here. A CUDA tensor is copied into its pinned host buffer on the training stream
        (``non_blocking``: the host goes on), so the step's kernels, and any later refill of the batch, are ordered
        after the copy: it has landed before any of the step's kernels can fail (the Recorder's step markers tell
        the host when, without asking the device).
        """
        key = (self._position, self._leaf)
        self._leaf += 1
        slot = self.slots.get(key)
        if key[0] < self._kept_steps and slot is not None:
            slot = self._swap(key, slot)
        if slot is None or slot.shape != t.shape or slot.dtype != t.dtype:
            if slot is not None:
                self.free(key)
            slot = self._new(key, t)
        if t.requires_grad:
            t = t.detach()
        if not t.is_cuda:
            return slot.copy_(t)
        self.copied.add(t.device)
        return slot.copy_(t, non_blocking=True)

    # --- buffers -------------------------------------------------------------------------

    def _swap(self, key: Key, held: torch.Tensor) -> torch.Tensor | None:
        """The buffer at ``key`` is held by a kept step: put the spare of ``key`` in its place (None: there is none,
        the caller makes one), and keep the held one as the spare (free for the next swap once the kept window is
        dropped). Spares count as held host memory, not as any position's."""
        spare = self.spares.pop(key, None)
        self.spares[key] = held
        self._count(key, held, -1, pool=False)
        if spare is None:
            del self.slots[key]
            return None
        self.slots[key] = spare
        self._count(key, spare, 1, pool=False)
        return spare

    def _new(self, key: Key, like: torch.Tensor) -> torch.Tensor:
        """A batch buffer for ``like`` at ``key``: pinned for a CUDA tensor, counted in the pool."""
        slot = self.slots[key] = torch.empty(like.shape, dtype=like.dtype, pin_memory=like.is_cuda)
        self._count(key, slot, 1)
        return slot

    def free(self, key: Key) -> None:
        """Free the buffer at ``key``."""
        self._count(key, self.slots.pop(key), -1)

    def free_after(self, position: int) -> None:
        """Free the buffers of every position after ``position`` (a window that restarts or stops short)."""
        for key in [key for key in self.slots if key[0] > position]:
            self.free(key)

    def free_spares(self) -> None:
        """Free the spare buffers (none is needed once the kept window is dropped)."""
        for key in list(self.spares):
            self._count(key, self.spares.pop(key), -1, at=False)

    def _count(self, key: Key, slot: torch.Tensor, sign: int, pool: bool = True, at: bool = True) -> None:
        """Count a buffer in (``sign`` 1) or out of the pool's bytes (``pool``) and its position's (``at``)."""
        n = sign * slot.numel() * slot.element_size()
        if pool:
            if slot.is_pinned():
                self.pinned += n
            else:
                self.pageable += n
        if at:
            self._at[key[0]] = self._at.get(key[0], 0) + n

    # --- byte counts -----------------------------------------------------------------------

    def bytes(self) -> int:
        """Bytes of every buffer, in use and spare (host memory held)."""
        return self.pinned + self.pageable

    def bytes_at(self, position: int) -> int:
        """Bytes of the buffers in use at ``position`` of the window (spares are no position's)."""
        return self._at.get(position, 0)

    def window_bytes(self, steps: int) -> int:
        """Bytes of the buffers of the window's first ``steps`` positions."""
        return sum(t.numel() * t.element_size() for key, t in self.slots.items() if key[0] < steps)

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer, in use or spare (kept alive to the process's end after a device error)."""
        return [*self.slots.values(), *self.spares.values()]

    def clear(self) -> None:
        """Drop every buffer (the Recorder closes)."""
        self.slots.clear()
        self.spares.clear()
        self._at.clear()
        self.pinned = self.pageable = 0
        self._flat = None
