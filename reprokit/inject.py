"""Fault injection: make a chosen step fail on purpose, to check that failures are caught.

In the spirit of Megatron-LM's rerun error injector: wrap your step function, name a fault and
the steps it hits, and check that the recorder detects it, writes a bundle and that
``reprokit replay --times N`` classifies it. Four faults:

``nan_loss``
    the step runs normally, then its loss reads NaN (the recorder's ``nonfinite_loss``); a dict or
    ``ModelOutput`` comes back with its ``"loss"`` entry NaN and the rest as the step returned it.
``inf_grad``
    every gradient flowing into the first trainable parameter becomes ``inf`` during backward,
    before the optimizer step (``nonfinite_grad``; the optimizer then writes non-finite weights).
``exception``
    the step raises :class:`InjectedFault` before it runs (``exception``).
``transient_nan``
    like ``nan_loss``, but only on the step's first execution in a training run: never during a
    replay (nor a shrink or bisect, which replay too), and not again if the loop re-runs the step.
    It models a fault that no recorded input explains (a flipped bit, a flaky device): replay
    must answer ``not_reproduced`` with its ``transient`` note, never "reproduced", never a fix.

Steps are numbered as the recorder numbers them (0 for the first ``rec.step``); replay sees the
recorded numbers. Outside a recorder or replay (a bare loop) the injector counts its own calls.

Example:
    >>> import reprokit.inject as inject
    >>> NAN_AT_7 = inject.FaultInjector("nan_loss", steps=[7])
    >>> @NAN_AT_7.wrap            # decorate at module level: replay imports the wrapped step by name
    ... def train_step(state, batch):
    ...     ...
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from reprokit.detect import current_step
from reprokit.errors import ReprokitError

FAULTS = ("nan_loss", "inf_grad", "exception", "transient_nan")


class InjectedFault(ReprokitError, RuntimeError):
    """The exception the ``exception`` fault raises inside the step (a stand-in for a bug in user code)."""


class FaultInjector:
    """Makes the wrapped step function fail with ``fault`` at each step in ``steps``.

    Args:
        fault: one of :data:`FAULTS`.
        steps: the step numbers to hit (as the recorder counts them, from 0).

    Attributes:
        fired: the steps at which the fault was injected, in order (replays included).
    """

    def __init__(self, fault: str, steps: Iterable[int]):
        if fault not in FAULTS:
            raise ReprokitError(f"unknown fault {fault!r}; expected one of {', '.join(FAULTS)}")
        self.fault = fault
        self.steps = frozenset(int(s) for s in steps)
        if not self.steps:
            raise ReprokitError("FaultInjector needs at least one step to hit (steps=[...])")
        self.fired: list[int] = []
        self._calls = 0

    def __repr__(self) -> str:
        return f"FaultInjector({self.fault!r}, steps={sorted(self.steps)})"

    def _due(self) -> int | None:
        """The step being run, when the fault hits it now."""
        where = current_step()
        if where is None:  # a bare loop: count calls
            step, replaying = self._calls, False
            self._calls += 1
        else:
            step, replaying = where
        if step not in self.steps:
            return None
        if self.fault == "transient_nan" and (replaying or step in self.fired):
            return None
        return step

    def wrap(self, step_fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        """``step_fn`` with the fault injected. Use as a decorator at module level (or assign the result to
        the same name), so that the name replay imports is the wrapped step."""

        @functools.wraps(step_fn)
        def step(state: Any, batch: Any) -> Any:
            k = self._due()
            if k is None:
                return step_fn(state, batch)
            self.fired.append(k)
            if self.fault == "exception":
                raise InjectedFault(f"injected exception at step {k} (reprokit.inject)")
            if self.fault == "inf_grad":
                return _with_inf_grads(state, step_fn, batch)
            return _nan_loss(step_fn(state, batch))

        return step


def _nan_loss(value: Any) -> Any:
    """What the step returned, with its loss reading NaN: a tensor, or the ``"loss"`` entry of a dict or
    ``ModelOutput`` (the rest of it kept for the caller), else the number NaN."""
    if isinstance(value, torch.Tensor):
        return value * float("nan")
    if isinstance(value, Mapping) and "loss" in value:
        out = copy.copy(value)
        out["loss"] = _nan_loss(value["loss"])  # type: ignore[index]
        return out
    return float("nan")


def _with_inf_grads(state: Any, step_fn: Callable[[Any, Any], Any], batch: Any) -> Any:
    param = next((p for p in state.model.parameters() if p.requires_grad), None)
    if param is None:
        raise ReprokitError("inf_grad: the model has no trainable parameter to inject into")
    handle = param.register_hook(lambda g: torch.full_like(g, float("inf")))
    try:
        return step_fn(state, batch)
    finally:
        handle.remove()
