"""The gradient norm's kernels captured as CUDA graphs, replayed while the gradients are where a capture saw them.

The recorder reads the gradients' global norm every step (:mod:`reprokit.detect`). Queued eagerly, one
``torch._foreach_norm`` over GPT-2-124M's 148 gradients costs about 1.2 ms of host time (H200, torch 2.11: an output
tensor per gradient, then a list of 148 Python tensors), beside 9 kernels. A loop the host cannot run ahead of, such
as a DDP step whose backward is host-heavy, pays that on every step. Replaying a CUDA graph of the same kernels costs
about 0.12 ms, the check of the gradients' layout included.

Exactness: a graph reads the memory its capture read, so it is replayed only when every gradient has the address,
shape, strides and dtype it had at the capture, grouped the same way (the layout, :func:`grads_key`, built each step);
otherwise the norm is queued eagerly. The caching allocator hands a step's gradients blocks in a few layouts that
recur (the last step's, or a short cycle of them); a layout is captured the second time it is seen, up to
``MAX_GRAPHS`` graphs are kept for replay (an evicted one is dropped once the stream has passed its last replay) and
at most ``MAX_CAPTURES`` made in a run. A replay queues the same
kernels with the same launch configurations as the eager call: the same value, bit for bit. Capture and replay
never wait for the device; a capture that fails turns the graphs off for the run (the norm is then queued eagerly)
and says so once.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from reprokit.errors import RecorderWarning

MAX_GRAPHS = 4
"""Graphs kept for replay, the most recently used: gradients whose blocks cycle through a few layouts hit one each step.
Each holds the norm's scratch memory on the device (a float per 64K-element chunk of the largest gradient, per
gradient: about 0.35 MB for GPT-2-124M, in a 2 MB segment of its own pool)."""
MAX_CAPTURES = 16
"""Captures a run may make: past it, the layouts kept are still replayed and the others normed eagerly."""


def grads_key(groups: list[list[torch.Tensor]]) -> tuple[Any, ...]:
    """What a graph captured over ``groups`` depends on: how they are grouped (each group is normed apart), and each
    gradient's address, shape, strides and dtype, in order."""
    return tuple(len(gs) for gs in groups), tuple((g.data_ptr(), g.shape, g.stride(), g.dtype) for gs in groups for g in gs)


class NormGraph:
    """``norm(groups)`` for one CUDA device, by graph replay when the gradients are where a capture saw them.

    Called with the stream the norm is queued on as the current stream (the recorder's side stream, never the
    default stream: a graph cannot be captured there). The result is a new tensor each call (a replay's output is
    copied out of the graph's static buffer on that stream), so a later replay never overwrites a norm still in use.
    A layout (:func:`grads_key`) is captured the second time it is seen among the last ``2 * MAX_GRAPHS`` layouts.
    """

    def __init__(self, norm: Callable[[list[list[torch.Tensor]]], torch.Tensor]):
        self.norm = norm
        self.graphs: OrderedDict[tuple[Any, ...], tuple[Any, torch.Tensor]] = OrderedDict()
        """Layout -> (graph, its output), least recently used first."""
        self.seen: OrderedDict[tuple[Any, ...], None] = OrderedDict()
        """Layouts seen once, not captured: the most recent ``2 * MAX_GRAPHS``."""
        self.captures = 0
        self.replays = 0
        self.eager = 0
        self.off: str | None = None
        """Why the graphs are off for this run (a capture failed), or None."""
        self._evicted: list[tuple[Any, torch.Tensor, torch.cuda.Event]] = []
        """Graphs evicted from :attr:`graphs`, each kept with an event recorded on the stream when it was evicted,
        until that event has passed (queried, never waited for): a replay of it may still be running."""

    def __call__(self, groups: list[list[torch.Tensor]]) -> torch.Tensor:
        if self.off is not None:
            self.eager += 1
            return self.norm(groups)
        if self._evicted:
            self._evicted = [e for e in self._evicted if not e[2].query()]
        key = grads_key(groups)
        hit = self.graphs.get(key)
        if hit is None:
            if key not in self.seen or self.captures >= MAX_CAPTURES:
                self.seen[key] = None
                self.seen.move_to_end(key)
                while len(self.seen) > 2 * MAX_GRAPHS:
                    self.seen.popitem(last=False)
                self.eager += 1
                return self.norm(groups)
            del self.seen[key]
            hit = self._capture(groups, key)
            if hit is None:
                self.eager += 1
                return self.norm(groups)
        else:
            self.graphs.move_to_end(key)
        graph, out = hit
        graph.replay()
        self.replays += 1
        return out.clone()

    def _capture(self, groups: list[list[torch.Tensor]], key: tuple[Any, ...]) -> tuple[Any, torch.Tensor] | None:
        """Capture ``norm(groups)`` on the current stream (nothing runs: the kernels are recorded). None, and the
        graphs off for the run, when the capture fails."""
        graph = torch.cuda.CUDAGraph()
        self.captures += 1
        try:
            # thread_local: other threads' CUDA calls (NCCL's watchdog, a data loader's pinning) stay legal meanwhile.
            # Not torch.cuda.graph(): it synchronizes the device and empties the allocator's cache first.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                out = self.norm(groups)
            finally:
                graph.capture_end()
        except Exception as e:
            self.off = f"capture failed: {e!r}"
            warnings.warn(f"reprokit: the gradient norm is queued eagerly from here on (its CUDA graph {self.off})",
                          RecorderWarning, stacklevel=3)
            if torch.cuda.is_current_stream_capturing():  # the capture could not be ended: nothing can run here
                raise
            return None
        self.graphs[key] = (graph, out)
        while len(self.graphs) > MAX_GRAPHS:
            old, old_out = self.graphs.popitem(last=False)[1]
            passed = torch.cuda.Event()
            passed.record()  # on this stream, after every replay of the evicted graph
            self._evicted.append((old, old_out, passed))
        return graph, out

    def close(self) -> None:
        """Drop the graphs (after the stream they ran on has been waited for: see :meth:`Monitor.close`)."""
        self.graphs.clear()
        self.seen.clear()
        self._evicted.clear()

    def stats(self) -> dict[str, Any]:
        return {"replays": self.replays, "eager": self.eager, "captures": self.captures, "off": self.off}
