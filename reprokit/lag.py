"""Lagged checks: each step's check values reach the host without the host waiting for the device.

After a step, the :class:`~reprokit.detect.Monitor` reduces what the detectors read (the loss, the gradient norm,
the parameter norm, the GradScaler's scale) into one small float64 tensor on the device and queues its copy into
pinned host memory (``non_blocking``), with a CUDA event after it: a :class:`Reading`. :class:`CheckQueue` keeps
the readings in step order and hands one to the detectors once its event has completed (``Event.query()``,
which never waits), so the host goes on queueing the next steps while the device catches up, as it does in a
loop without the recorder. Readings are judged strictly in step order (the spike history and the GradScaler's skip
streak depend on it), so the failure found is always the first step whose values fired, whenever it is seen.

The lag is bounded. A reading ``max_lag`` steps old is waited for (``Event.synchronize()`` on that reading's event:
the host waits only where the device is that far behind), and :meth:`CheckQueue.take` with ``wait=True`` waits for
every reading when something needs every earlier step judged (the recorder's snapshot that starts a new window,
its memory budget, ``Recorder.wait_for_checks()`` and ``close()``). ``max_lag=0`` judges every step at its own end:
one wait per step, as before lagged checks (what replay uses: it stops at the failing step).

On a CPU the values are on the host as soon as they are computed: the same path, ready at once. Tests force lag
deterministically through :attr:`CheckQueue.ready_after`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

WIDTH = 4
"""Values per reading at most: loss, gradient norm, parameter norm, the GradScaler's scale (in that order)."""


@dataclass(slots=True)
class Reading:
    """One step's check values on their way to the host."""

    step: int
    values: torch.Tensor | None
    """float64 on the host (pinned for a CUDA reading, filled once ``event`` has completed), in ``parts`` order."""
    parts: tuple[bool, bool, bool, bool]
    """Which of loss, grad norm, param norm and scale ``values`` holds."""
    event: Any = None
    """The ``torch.cuda.Event`` recorded after the copy; None for values already on the host."""
    number_loss: float | None = None
    """A loss the step returned as a Python number (on the host from the start)."""
    device: Any = None
    """The CUDA device of ``event`` (its buffer and event go back to that device's spares)."""


@dataclass(slots=True)
class Checked:
    """One step's check values as read on the host."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    param_norm: float | None = None
    scale: float | None = None


class CheckQueue:
    """The readings of steps not judged yet, oldest first. One per :class:`~reprokit.detect.Monitor`."""

    def __init__(self, max_lag: int = 0):
        self.max_lag = max_lag
        """A reading this many steps old is waited for (0: every step is judged at its own end)."""
        self.pending: deque[Reading] = deque()
        self.ready_after: int | None = None
        """Test seam: when set, a reading counts as ready only once this many steps have run after its step (or when
        it is waited for), whatever its event says, so that a test on the CPU sees the lag a GPU would give. Leave
        None in real runs."""
        self._spare: dict[Any, list[tuple[torch.Tensor, Any]]] = {}
        self.lags = {"checks": 0, "lag_total": 0, "lag_max": 0, "waits": 0}
        """How many readings were judged, the steps that ran after each before it was (total and most), and how many
        times the host waited for one."""

    def __len__(self) -> int:
        return len(self.pending)

    def reserve(self, device: torch.device) -> tuple[torch.Tensor, Any]:
        """A pinned host buffer of :data:`WIDTH` float64 values and an event for a reading on CUDA ``device``,
        reused reading after reading (at most ``max_lag + 1`` are in flight, so steady state allocates nothing)."""
        spare = self._spare.get(device)
        if spare:
            return spare.pop()
        return torch.empty(WIDTH, dtype=torch.float64, pin_memory=True), torch.cuda.Event()

    def push(self, reading: Reading) -> None:
        self.pending.append(reading)

    def take(self, ran: int, *, wait: bool = False) -> Iterator[Reading]:
        """Pop the readings that are ready, oldest first, stopping at the first that is not.

        ``ran`` is the last step that has run: a reading ``max_lag`` or more steps older than it, and every reading
        with ``wait``, is waited for (one ``Event.synchronize()``; counted in :attr:`lags`). The caller judges each
        reading as it comes, and calls :meth:`clear` when one fails (the readings after it are not judged).
        """
        while self.pending:
            r = self.pending[0]
            age = ran - r.step
            try:
                if not self._ready(r, age):
                    if not (wait or age >= self.max_lag):
                        return
                    self.lags["waits"] += 1
                    if r.event is not None:
                        r.event.synchronize()
            except Exception:  # the device failed: this reading is never read (the caller says so)
                self.pending.popleft()
                raise
            self.pending.popleft()
            self.lags["checks"] += 1
            self.lags["lag_total"] += max(0, age)
            self.lags["lag_max"] = max(self.lags["lag_max"], age)
            yield r

    def _ready(self, r: Reading, age: int) -> bool:
        if self.ready_after is not None:
            return age >= self.ready_after
        return r.event is None or bool(r.event.query())

    def values(self, r: Reading) -> Checked:
        """The host values of a reading that :meth:`take` gave (its buffer goes back to the spares)."""
        got = r.values.tolist() if r.values is not None else []
        if r.event is not None and r.values is not None:
            self._spare.setdefault(r.device, []).append((r.values, r.event))
        got = got[:sum(r.parts)]
        has_loss, has_grad, has_param, has_scale = r.parts
        return Checked(r.step, got.pop(0) if has_loss else r.number_loss, got.pop(0) if has_grad else None,
                       got.pop(0) if has_param else None, got.pop(0) if has_scale else None)

    def clear(self) -> None:
        """Forget the readings not judged yet (the steps after a failure; a replay restoring a snapshot)."""
        self.pending.clear()

    def stats(self) -> dict[str, Any]:
        """``lag_max`` and ``lag_mean``: the steps that ran after a step before its check was judged; ``lag_waits``:
        how many times the host waited for a check; ``checks_pending`` now."""
        n = self.lags["checks"]
        return {"max_lag": self.max_lag, "lag_max": self.lags["lag_max"],
                "lag_mean": self.lags["lag_total"] / n if n else 0.0, "lag_waits": self.lags["waits"],
                "checks_pending": len(self.pending)}
