"""Detectors: decide, after each step, whether training just failed.

The :class:`Monitor` is shared by the recorder and the replayer so that a
bundle is judged on replay by exactly the rules that recorded it. Per step it
reduces the loss, grad norm, param norm and the GradScaler's scale into one small
tensor on the device and copies it to pinned host memory without waiting; the
detectors judge it once it has landed (:mod:`reprokit.lag`), up to ``max_lag``
steps later in the recorder, at the step's own end in replay. An exception in
the step is judged at once (it is the host's own).

On a CUDA device the gradient norm is queued on a side stream when the optimizer
is about to step, and the training stream waits for it only when the optimizer
step has been queued: the norm (a memory-bound read of every gradient, ~0.2-0.3 ms
for GPT-2-124M on an H200) runs beside the optimizer's kernels instead of before
them. Measured on GPT-2-124M (H200): the norm in line cost 1.010x the bare step, on the
side stream 0.999x.
"""

from __future__ import annotations

import numbers
import os
import statistics
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import torch

from reprokit import pytree
from reprokit.detect_settings import DetectSettings
from reprokit.device_error import is_sticky
from reprokit.errors import ConfigError, RecorderWarning
from reprokit.lag import Checked, CheckQueue, Reading
from reprokit.signature import Failure, FailureKind, from_exception
from reprokit.state import TrainState

_GRAD = attrgetter("grad")
_SKIPPED = -1.0
"""The grad norm of a step the GradScaler skipped on the device (norms are never negative)."""

Predicate = Callable[[int, "float | None", TrainState], Any]

LAGGED = "__reprokit_lagged__"
"""The attribute :func:`lagged` sets on a predicate."""


def lagged(fn: Predicate) -> Predicate:
    """Mark a predicate that may be judged up to ``max_lag`` steps after its step, like the built-in checks.

    A predicate ``fn(step, loss, state)`` is called with its step's loss as a float, which is on the host only once
    the device has finished that step. By default a Recorder given predicates therefore judges every step at its own
    end (one host wait per step, as before checks lagged), so that ``state`` (``state.extra`` above all) is the state
    that step left. A predicate marked ``lagged`` reads only ``step`` and ``loss`` (or does not mind that ``state``
    is the live one, up to ``max_lag`` steps further on): it is judged when its step's check resolves and costs no
    wait. Replay judges every predicate at its step's end either way.

    Returns ``fn`` itself (so it stays importable by its name, as replay needs).

    Example:
        >>> @lagged
        ... def loss_above(step, loss, state):
        ...     return loss is not None and loss > 1e3
        >>> is_lagged(loss_above)
        True
    """
    try:
        setattr(fn, LAGGED, True)
    except (AttributeError, TypeError) as e:
        raise ConfigError(f"cannot mark {fn!r} as lagged ({e}); mark a module-level function instead") from None
    return fn


def is_lagged(fn: Predicate) -> bool:
    """Whether ``fn`` was marked with :func:`lagged`."""
    return bool(getattr(fn, LAGGED, False))


_RUNNING: ContextVar[tuple[int, bool] | None] = ContextVar("reprokit_running_step", default=None)


def current_step() -> tuple[int, bool] | None:
    """``(step, replaying)`` of the step a :class:`Monitor` is running now (the recorder's during training,
    a replay's during replay, shrink and bisect), or None outside one. Read by :mod:`reprokit.inject`."""
    return _RUNNING.get()


@dataclass
class StepResult:
    """What one watched step did."""

    loss: float | None
    grad_norm: float | None
    failure: Failure | None
    exc: BaseException | None = None
    value: Any = None
    """What the step function returned; a tensor that requires grad comes back detached (see :meth:`Monitor.run`)."""
    checked: list[Checked] = field(default_factory=list)
    """Every step whose checks were judged since the last result, oldest first (this step's too when judged now;
    ``loss`` and ``grad_norm`` above are this step's, None while its check is still on its way)."""
    lag: int = 0
    """Steps that ran after the failing step before its failure was seen (0: at its own step's end)."""
    later: BaseException | None = None
    """An exception the current step raised after an earlier step's check had fired (seen when it raised)."""


class Monitor:
    """Runs one step under watch. Create one per (state, run); call :meth:`close` after.

    ``max_lag``: how many steps a step's check may be judged after it (see :mod:`reprokit.lag`); 0 judges every
    step at its own end (replay). Predicates not marked :func:`lagged` judge every step at its own end too.
    """

    def __init__(self, state: TrainState, settings: DetectSettings, predicates: Sequence[Predicate] = (),
                 max_lag: int = 0):
        self.state = state
        self.settings = settings
        self.predicates = list(predicates)
        self.checks = CheckQueue(max_lag)
        self.noticed: StepResult | None = None
        """A failure found between steps (:meth:`settle`): the next :meth:`run` returns it without running its step."""
        self._unreported: list[Checked] = []
        """Steps judged since the last result was returned (they go into its ``checked``)."""
        self._host_each_step = any(not is_lagged(fn) for fn in self.predicates)
        """A predicate reads ``state`` as its step left it: judge every step at its own end."""
        self.history: deque[float] = deque(maxlen=settings.spike_window)
        self.skip_streak = 0
        self.last_scale: float | None = None
        self._norms: list[torch.Tensor] = []
        self._groups: tuple[int, list[list[torch.Tensor]]] | None = None
        self._sharded = False
        self._side: dict[torch.device, torch.cuda.Stream] = {}
        self._unjoined: list[torch.cuda.Stream] = []
        self._dead: BaseException | None = None
        """The sticky device error a lagged read met (see :meth:`_judge`): the failure's exception."""
        self._held: list[Any] = []
        """What the norms queued aside read, kept alive until the training stream waits for them (see _norm_aside)."""
        """Side streams with a norm queued that the training stream has not waited for yet."""
        self._hooks: tuple[Any, Any] | None = None
        self._hook_warned = False
        self._loss_warned = False
        self._spike_warned = False
        self._after_closure = False
        """Set by the pre-hook when step() was given a closure: the norm is read after the step."""
        self.replaying = False
        """Set by replay: the steps this monitor runs re-execute recorded ones (see :func:`current_step`)."""
        self.attach()

    def close(self) -> None:
        if self._hooks is not None:
            for h in self._hooks:
                h.remove()
            self._hooks = None
        self._join()

    def attach(self) -> None:
        if self._hooks is None and self.settings.check_grads:
            opt = self.state.optimizer
            self._hooks = (opt.register_step_pre_hook(self._on_optimizer_step),
                           opt.register_step_post_hook(self._after_optimizer_step))

    # The monitor's own counters travel with snapshots so replay starts where recording was.
    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history), "skip_streak": self.skip_streak, "last_scale": self.last_scale}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.checks.clear()  # a replay restoring its snapshot: readings of the steps it ran are void
        self.noticed = None
        self._unreported = []
        self.history = deque(d.get("history", []), maxlen=self.settings.spike_window)
        self.skip_streak = int(d.get("skip_streak", 0))
        self.last_scale = d.get("last_scale")

    def _grad_groups(self, optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
        """The optimizer's parameters grouped by (device, dtype), computed once: the hot path only gathers."""
        n = sum(len(g["params"]) for g in optimizer.param_groups)
        if self._groups is None or self._groups[0] != n:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self._sharded = any(type(p) not in _PLAIN and pytree.is_dtensor(p) for p in params)
            self._groups = (n, group_by_device_dtype(params))
        return self._groups[1]

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            # The hook's args start with the optimizer itself; anything after it is the caller's.
            extra = args[1:] if args and args[0] is optimizer else args
            closure = kwargs.get("closure", extra[0] if extra else None)
            if callable(closure) and not isinstance(getattr(optimizer, "grad_scale", None), torch.Tensor):
                # The closure computes this step's gradients inside step() (Lightning's automatic optimization,
                # LBFGS): the ones here are the last step's. Read them in the post-hook.
                self._after_closure = True
                return
            grads = [gs for gs in ([g for g in map(_GRAD, ps) if g is not None] for ps in self._grad_groups(optimizer))
                     if gs]
            if not grads:
                return
            if self._sharded:  # FSDP2: each rank checks its own shards (a global norm would need a collective)
                grads = [[local_shard(g) for g in gs] for gs in grads]
            # A GradScaler driving an optimizer with its own AMP handling (fused Adam/AdamW/SGD)
            # calls step() on every step, overflowed ones too, and hands it the scale and an
            # overflow flag: the gradients seen here may still be scaled (the fused kernel
            # unscales them and writes them back), and an overflowed step is skipped on the device.
            scale, found_inf = (t if isinstance(t := getattr(optimizer, name, None), torch.Tensor) else None
                                for name in ("grad_scale", "found_inf"))
            calls_back = any(a is not None for a in (*extra, *kwargs.values()))
            if scale is not None or calls_back:
                # The step writes the gradients (or may: a grad_scaler argument): in line.
                self._norms.append(_amp_adjusted(_norm_of_groups(grads), scale, found_inf))
            else:
                self._norms.append(self._norm_aside(grads, found_inf))
        except Exception as e:  # never break the user's optimizer step
            if not self._hook_warned:
                self._hook_warned = True
                warnings.warn(f"reprokit: gradient-norm check disabled: {e!r}", RecorderWarning, stacklevel=2)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            if self._after_closure:
                self._after_closure = False
                grads = [gs for gs in ([g for g in map(_GRAD, ps) if g is not None]
                                       for ps in self._grad_groups(optimizer)) if gs]
                if grads:
                    self._norms.append(_norm_of_groups(grads))
            self._join()
        except Exception as e:  # never break the user's optimizer step
            if not self._hook_warned:
                self._hook_warned = True
                warnings.warn(f"reprokit: gradient-norm check failed: {e!r}", RecorderWarning, stacklevel=2)

    def _norm_aside(self, grads: list[list[torch.Tensor]], found_inf: torch.Tensor | None = None) -> torch.Tensor:
        """The gradients' global norm; on one CUDA device, queued on a side stream.

        The side stream starts after everything queued so far (backward, clipping,
        unscaling); the training stream goes on to queue the optimizer step, which reads the
        gradients too, and waits for the side stream in the optimizer's post-hook, before
        anything after the step could write or free them. The gradients (and the overflow flag) are held here until
        that wait, which covers an optimizer that frees gradients inside its own step: their memory cannot go back to
        the training stream's pool before the training stream waits for the norm. (``record_stream`` did this before,
        at a host cost per gradient and per later allocation: it makes the caching allocator record an event for
        every gradient freed and poll them on each allocation until the side stream passes.) CPU gradients, gradients on
        several devices and steps under CUDA-graph capture take the norm in line. A
        GradScaler's overflow flag is applied on the side stream too (the training stream
        must not read the norm before the post-hook's wait).
        """
        dev = grads[0][0].device
        if dev.type != "cuda" or any(gs[0].device != dev for gs in grads) or \
                torch.cuda.is_current_stream_capturing():
            return _amp_adjusted(_norm_of_groups(grads), None, found_inf)
        side = self._side.get(dev)
        if side is None:
            side = self._side[dev] = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            norm = _amp_adjusted(_norm_of_groups(grads), None, found_inf)
        self._held.append((grads, found_inf))
        self._unjoined.append(side)
        return norm

    def warm_up(self) -> None:
        """Run the step-end checks' device work once, on the parameters themselves (nothing is kept or changed).

        CUDA loads a kernel when it is first used: for the float64 norms that took ~70 ms on an H200, all in the
        recorder's first step. Done here, it is part of making the Recorder (setup, like building the model).
        """
        params = [local_shard(p.detach()) for g in self.state.optimizer.param_groups for p in g["params"]]
        if not (self.settings.check_grads or self.settings.check_params) or not any(p.is_cuda for p in params):
            return
        with torch.no_grad():
            norm = global_norm(params)
            # The same promotion and copy as _measure's: a float32 value beside the float64 norm, into a pinned
            # buffer of the check queue (kept for the first step), then waited for, once.
            values = torch.cat([norm.new_zeros(1, dtype=torch.float32), norm.reshape(1)])
            host, event = self.checks.reserve(values.device)
            host[:2].copy_(values, non_blocking=True)
            event.record(torch.cuda.current_stream(values.device))
            event.synchronize()
            self.checks.values(Reading(-1, host, (True, True, False, False), event=event, device=values.device))

    def _join(self) -> None:
        """Make the training stream wait for the norms queued aside (a device-side wait, not a sync); the tensors they
        read may be freed from then on (their memory is reused in stream order, after the wait)."""
        for side in self._unjoined:
            torch.cuda.current_stream(side.device).wait_stream(side)
        self._unjoined.clear()
        self._held.clear()

    def run(self, step_fn: Callable[[TrainState, Any], Any], batch: Any, step: int,
            after: Callable[[], None] | None = None) -> StepResult:
        """Run ``step_fn(state, batch)`` and the detectors. Never raises the step's exception: returns it.

        ``after()`` runs as soon as the step function returns or raises, before the loss
        is read: work queued there overlaps with the device finishing the step.

        A returned tensor that requires grad (the loss, after its backward) is replaced by
        ``loss.detach()`` here, so that its autograd graph is freed now, while the device is
        still busy, and not when the caller drops it after the loss read: freeing a GPT-2
        graph (~650 nodes) takes ~0.2 ms of host time, all of it on the critical path there.

        When an earlier step's check fired before this one started (:meth:`settle`), the step function is not run:
        that failure is returned.
        """
        if self.noticed is not None:
            if after is not None:
                after()
            return self._collect(step=step)
        self.begin()
        token = _RUNNING.set((step, self.replaying))
        try:
            loss = step_fn(self.state, batch)
        except Exception as e:
            if after is not None:
                after()
            return self.conclude(step, exc=e)
        finally:
            _RUNNING.reset(token)
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss = loss.detach()
        if after is not None:
            after()
        return self.conclude(step, loss)

    def begin(self) -> None:
        """A step starts: forget the last one's gradient norms. (:meth:`run` does this; a loop that a framework
        drives calls ``begin`` and :meth:`conclude` around the step itself.)"""
        self._norms.clear()
        self._after_closure = False

    def conclude(self, step: int, loss: Any = None, exc: BaseException | None = None) -> StepResult:
        """Queue the step's loss and gradient norms for the host and judge the readings that have landed; with
        ``exc``, the step raised it.

        The result's ``failure`` is the first step whose check fired, which may be an earlier step's (``lag`` says
        how many steps ago). An exception is judged at once, after every earlier step (their checks are waited for:
        a step that fired before it is the failure, and the exception comes back as ``later``).
        """
        if self.noticed is not None:  # seen before this step (a framework that ran the step anyway)
            return self._collect(step=step)
        if exc is not None:
            try:
                self._join()  # an optimizer step that raised never reached the post-hook
            except Exception:  # a dead device (a sticky error): the step's own exception is what it says
                self._unjoined.clear()
            # The steps before it are judged first (a host wait): a step that fired before it is the failure, and the
            # exception comes back as `later`. Not on a dead device: their readings are gone with it.
            earlier = None if is_sticky(exc) else self._judge(step, wait=True)
            if earlier is not None:
                return self._collect(StepResult(None, None, earlier, self._dead, lag=step - earlier.step, later=exc),
                                     step)
            return self._collect(StepResult(None, None, from_exception(exc, step), exc), step)
        if isinstance(loss, torch.Tensor):
            if loss.requires_grad:
                loss = loss.detach()
            read = loss
        else:  # a number, a dict / ModelOutput holding the loss, or something the loss checks cannot read
            read = self._loss_in(loss, step)
        try:
            self.checks.push(self._measure(read, step))
        except Exception as e:  # reprokit's own fault: the run goes on, unchecked for this step, and says so once
            if is_sticky(e):  # the step's kernels killed the device: its error surfaced in this read
                return self._collect(StepResult(None, None, from_exception(e, step), e), step)
            self._unchecked(step, e)
        failure = self._judge(step, wait=self._host_each_step)
        if failure is not None:
            return self._collect(StepResult(None, None, failure, self._dead, lag=step - failure.step, value=loss),
                                 step)
        return self._collect(StepResult(None, None, None, value=loss), step)

    def settle(self, ran: int, wait: bool = False) -> bool:
        """Judge the readings that have landed (with ``wait``, every one: a host wait), between steps; ``ran`` is the
        last step that ran. True when every step so far is judged and none failed; a failure found is kept in
        :attr:`noticed` (the next :meth:`run` or :meth:`conclude` returns it)."""
        if self.noticed is None:
            failure = self._judge(ran, wait=wait)
            if failure is not None:
                self.noticed = StepResult(None, None, failure, self._dead, lag=ran - failure.step)
        return self.noticed is None and not self.checks.pending

    def collect(self) -> StepResult:
        """What was judged between steps (:meth:`settle`): the failure :attr:`noticed`, or a result without one,
        with the steps judged."""
        return self._collect(None if self.noticed is not None else StepResult(None, None, None))

    def _collect(self, result: StepResult | None = None, step: int | None = None) -> StepResult:
        """``result`` (or the failure :attr:`noticed`) with every step judged since the last one returned; the loss
        and grad norm of ``step`` when it is among them."""
        if result is None:
            result, self.noticed = self.noticed, None
            assert result is not None
        result.checked, self._unreported = self._unreported, []
        for c in reversed(result.checked):
            if c.step == step:
                result.loss, result.grad_norm = c.loss, c.grad_norm
                break
        return result

    def _judge(self, ran: int, wait: bool) -> Failure | None:
        """Run the detectors on the readings that are ready, oldest first; the first failure, or None."""
        try:
            for reading in self.checks.take(ran, wait=wait):
                c = self.checks.values(reading)
                self._unreported.append(c)
                if c.grad_norm is not None and c.grad_norm == _SKIPPED:
                    c.grad_norm = None  # the GradScaler skipped the step: its gradients do not count
                failure = self._check(c.step, c.loss, c.grad_norm, c.param_norm, c.scale)
                if failure is not None:
                    self.checks.clear()  # the steps after it are not judged: their window ends at the failure
                    return failure
        except Exception as e:
            if is_sticky(e):  # the device died since: its error surfaced in this read, and it is the failure
                self._dead = e
                self.checks.clear()
                return from_exception(e, ran)
            self._unchecked(ran, e)  # a reading that cannot be read: that step goes unchecked
        return None

    def _unchecked(self, step: int, e: Exception) -> None:
        if not self._hook_warned:
            self._hook_warned = True
            warnings.warn(f"reprokit: could not read the loss and norms after step {step}, so that step went "
                          f"unchecked: {e!r}", RecorderWarning, stacklevel=4)

    def _loss_in(self, value: Any, step: int) -> Any:
        """The loss inside what the step returned when it is not a tensor: a number, or the ``"loss"`` entry of a
        dict or Hugging Face ``ModelOutput``; else None, said once (the loss checks would silently not run)."""
        if not self.settings.loss_from_mapping:  # a bundle recorded before these were read: judge it as it was
            return None
        if isinstance(value, Mapping) and "loss" in value:
            value = value["loss"]
            if isinstance(value, torch.Tensor):
                return value
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            return float(value)
        if value is None and self.settings.spike_factor is None:
            return None  # a step that returns nothing: only the gradient and parameter checks run, as documented
        self._warn_unread(step, f"returned {_what(value)}, not a loss")
        return None

    def _warn_unread(self, step: int, what: str) -> None:
        if not self._loss_warned:
            self._loss_warned = True
            warnings.warn(f"reprokit: the step function {what} (step {step}), so the loss checks (non-finite loss, "
                          "spike_factor, the `loss` given to predicates) cannot see it. Return the loss as a "
                          "one-element tensor or a number, or a dict / ModelOutput with a 'loss' entry.",
                          RecorderWarning, stacklevel=6)

    def _measure(self, loss: Any, step: int = -1) -> Reading:
        """Loss, grad norm, param norm and the GradScaler's scale, on their way to the host without a wait.

        One ``torch.cat`` (it promotes every part to float64) and, on a GPU, one non-blocking copy into a pinned
        buffer with an event after it: the bare loop's ``loss.item()`` becomes a single small kernel and a copy that
        the host never waits for. On the CPU the values are on the host at once.
        """
        self._join()  # normally done in the optimizer post-hook already
        parts: list[torch.Tensor] = []
        has_loss = isinstance(loss, torch.Tensor) and loss.numel() == 1
        if has_loss:
            parts.append(loss.detach().reshape(1))
        elif isinstance(loss, torch.Tensor) and not self._loss_warned:
            self._warn_unread(step, f"returned a tensor of shape {list(loss.shape)}, not a one-element loss")
        has_grad = bool(self._norms)
        if has_grad:
            # With accumulation the optimizer may step several times: keep the worst.
            norms = self._norms
            parts.append(norms[0].reshape(1) if len(norms) == 1 else torch.stack([n.to(norms[0].device)
                                                                                  for n in norms]).max().reshape(1))
        has_param = False
        if self.settings.check_params:
            params = [local_shard(p.detach()) for p in self.state.model.parameters()]
            if params:
                parts.append(global_norm(params).reshape(1))
                has_param = True
        # The GradScaler's scale rides along in the same copy (get_scale() would sync).
        scale_t = getattr(self.state.scaler, "_scale", None) if self.state.scaler_enabled() else None
        dev = parts[0].device if parts else None
        has_scale = isinstance(scale_t, torch.Tensor) and (dev is None or scale_t.device == dev)
        if has_scale:
            parts.append(scale_t.detach().reshape(1))  # type: ignore[union-attr]
            dev = dev or scale_t.device  # type: ignore[union-attr]
        number = float(loss) if not has_loss and isinstance(loss, (int, float)) else None
        layout = (has_loss, has_grad, has_param, has_scale)
        if not parts:
            return Reading(step, None, layout, number_loss=number)
        if any(p.device != dev for p in parts):
            parts = [p.to(dev) for p in parts]
        values = torch.cat([p.to(torch.float64) if not p.is_floating_point() else p for p in parts])
        if values.device.type != "cuda":  # the CPU (or a device without events: read now, as before)
            return Reading(step, values.to("cpu"), layout, number_loss=number)
        if values.dtype != torch.float64:
            values = values.to(torch.float64)
        host, event = self.checks.reserve(values.device)
        host[:len(values)].copy_(values, non_blocking=True)
        event.record(torch.cuda.current_stream(values.device))
        return Reading(step, host, layout, event=event, number_loss=number, device=values.device)

    def _check(self, step: int, loss: float | None, grad_norm: float | None,
               param_norm: float | None, read_scale: float | None = None) -> Failure | None:
        s = self.settings
        if s.check_loss and loss is not None and not _finite(loss):
            return Failure(FailureKind.NONFINITE_LOSS, step, message=f"loss = {loss}")
        if grad_norm is not None and not _finite(grad_norm):
            return Failure(FailureKind.NONFINITE_GRAD, step, message=f"grad norm = {grad_norm}")
        if param_norm is not None and not _finite(param_norm):
            return Failure(FailureKind.NONFINITE_PARAM, step, message=f"param norm = {param_norm}")
        if self.state.scaler_enabled():
            scale = read_scale if read_scale is not None else float(self.state.scaler.get_scale())
            skipped = self.last_scale is not None and scale < self.last_scale
            self.skip_streak = self.skip_streak + 1 if skipped else 0
            self.last_scale = scale
            if self.skip_streak >= s.scaler_patience:
                return Failure(FailureKind.SCALER_COLLAPSE, step,
                               message=f"{self.skip_streak} skipped steps in a row, scale = {scale}")
        if s.spike_factor is not None and loss is not None and len(self.history) >= min(10, s.spike_window):
            median = statistics.median(self.history)
            if median > 0 and loss > s.spike_factor * median:
                return Failure(FailureKind.LOSS_SPIKE, step,
                               message=f"loss {loss:.4g} > {s.spike_factor} x median {median:.4g}",
                               detail={"loss": loss, "median": median, "factor": s.spike_factor})
            if median <= 0 and not self._spike_warned:
                self._spike_warned = True
                warnings.warn(f"reprokit: spike_factor cannot judge step {step}: the median of the recent losses is "
                              f"{median:.4g}, and a multiple of a loss <= 0 is no bound; the spike check is off while "
                              "it stays <= 0. Give the recorder a loss that stays positive (say, shifted by a "
                              "constant), or use a predicate (detect=[...]) for this loss.",
                              RecorderWarning, stacklevel=5)
        if loss is not None and _finite(loss):
            self.history.append(loss)
        for fn in self.predicates:
            try:
                verdict = fn(step, loss, self.state)
            except Exception as e:
                return from_exception(e, step)
            try:
                fired = bool(verdict)
            except Exception as e:  # a tensor of several values, a numpy array: no single truth value
                return _unjudged(fn, verdict, e, step)
            if fired:
                name = getattr(fn, "__qualname__", repr(fn))
                return Failure(FailureKind.PREDICATE, step, frame=name,
                               message=verdict if isinstance(verdict, str) else f"{name} returned {verdict!r}")
        return None


def _amp_adjusted(norm: torch.Tensor, scale: torch.Tensor | None, found_inf: torch.Tensor | None) -> torch.Tensor:
    """The norm of the unscaled gradients, or ``_SKIPPED`` where the GradScaler found an overflow (on the device)."""
    if scale is not None:
        norm = norm / scale.to(norm.device, torch.float64)
    if found_inf is not None:
        norm = torch.where(found_inf.to(norm.device) > 0, _SKIPPED, norm)
    return norm


def group_by_device_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded DTensor (FSDP2), or ``t`` itself: the checks never run a collective."""
    return t.to_local() if type(t) not in _PLAIN and pytree.is_dtensor(t) else t  # type: ignore[attr-defined]


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over many tensors, accumulated in float64 (huge but finite values must not read as inf)."""
    return _norm_of_groups(group_by_device_dtype([t.detach() for t in tensors]))


def _norm_of_groups(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    with torch.no_grad():
        parts = [torch.linalg.vector_norm(torch.stack(_foreach_norm64(ts))) for ts in groups]
        dev = parts[0].device
        return parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack([p.to(dev) for p in parts]))


def _foreach_norm64(ts: list[torch.Tensor]) -> list[torch.Tensor]:
    try:
        return list(torch._foreach_norm(ts, 2, dtype=torch.float64))
    except TypeError:  # torch < 2.3: no dtype argument
        return [n.double() for n in torch._foreach_norm(ts)]


def _unjudged(fn: Any, verdict: Any, error: Exception, step: int) -> Failure:
    """The failure for a predicate whose verdict has no truth value: a :class:`ConfigError` raised "in" it."""
    name = getattr(fn, "__qualname__", repr(fn))
    what = f"a tensor of shape {list(verdict.shape)}" if isinstance(verdict, torch.Tensor) else _what(verdict)
    err = ConfigError(f"predicate {name} returned {what}, which is neither true nor false ({error}); a predicate "
                      "returns a bool, or a str to fail with that message (for a tensor: bool((x > limit).any()))")
    failure = from_exception(err, step)
    code = getattr(fn, "__code__", None)
    if code is not None:  # the predicate's own place, as if it had raised (its frame already returned)
        failure.frame = f"{os.path.basename(code.co_filename)}:{code.co_name}"
        failure.frame_qualname = f"{os.path.basename(code.co_filename)}:{getattr(code, 'co_qualname', code.co_name)}"
    return failure


def _what(value: Any) -> str:
    """``a tuple``, ``a list``, ``a str``: what a value is, for a message."""
    return "None" if value is None else f"a {type(value).__qualname__}"


def _finite(x: float) -> bool:
    return x == x and x not in (float("inf"), float("-inf"))
