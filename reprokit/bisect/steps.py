"""``reprokit bisect steps``: the first step at which something went bad, often before the NaN loss.

The window is replayed one step at a time with instrumentation: per-parameter gradient norms as backward left
them (read when each parameter's gradient is accumulated, so before any clipping; with a GradScaler divided by
its scale), the global norm the optimizer step received (read in an optimizer step pre-hook: after clipping),
each param group's learning rate as that step used it (read in the same pre-hook, so an LR the step function sets
itself is the one shown), a finiteness check of every parameter and every optimizer state tensor after the step,
and the scaler's scale.

A step is bad when something went non-finite, a norm or loss spiked over the median of the steps before it, the
scaler kept skipping, or, judged over the whole window, when the trajectory departed there: its loss (or
gradient norm) jumped well above every one of the few steps before it and never came back down before the
failure. An LR too high shows as that departure at once (loss 4.5 -> 23 -> 47), long before a spike over a median
that the divergence itself keeps raising.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from reprokit.bundle import Bundle
from reprokit.replayer import Session


@dataclass(kw_only=True, slots=True)
class StepRules:
    """When a step counts as bad."""

    explode_factor: float = 10.0
    """Grad norm above this many times the median of the steps before it."""
    spike_factor: float = 10.0
    """Loss above this many times the median of the steps before it."""
    skip_streak: int = 3
    """This many GradScaler-skipped steps in a row."""
    min_history: int = 3
    """Steps of history needed before the explode/spike rules apply."""
    loss_departure: float = 3.0
    """A loss above this many times the largest of the ``departure_window`` steps before it, with every later loss
    up to the failure above that level too (or non-finite), is where the trajectory departed."""
    norm_departure: float = 10.0
    """The same for the gradient norm (before clipping), which moves more from step to step than the loss."""
    departure_window: int = 5
    """How many steps before a step are its baseline for the departure rules (one is enough)."""


class _GradProbe:
    """Gradient norms as backward left them and as the optimizer step received them, and the LR that step used.

    Backward's norms are read in each parameter's post-accumulate-grad hook, which fires when backward has written
    that gradient and before the step function can touch it: clipping (``clip_grad_norm_``), unscaling or any other
    edit comes after. With accumulation over micro-batches the last read, the sum, is kept.
    """

    def __init__(self, state: Any):
        self.names = {id(p): n for n, p in state.model.named_parameters()}
        self.backward: dict[str, torch.Tensor] = {}
        self.stepped: dict[str, float] | None = None
        self.lrs: list[float] | None = None
        self.handles = [state.optimizer.register_step_pre_hook(self._hook)]
        if hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):  # torch >= 2.1
            for name, p in state.model.named_parameters():
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(self._accumulated(name)))

    def reset(self) -> None:
        self.backward, self.stepped, self.lrs = {}, None, None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()

    def _accumulated(self, name: str) -> Any:
        def hook(p: torch.Tensor) -> None:
            if p.grad is not None:
                with torch.no_grad():
                    self.backward[name] = torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float64)
        return hook

    def _hook(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.lrs = [float(g["lr"]) for g in opt.param_groups]
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if params:
            with torch.no_grad():
                norms = torch.stack([torch.linalg.vector_norm(p.grad.detach().float()) for p in params]).tolist()
            self.stepped = {self.names.get(id(p), f"param{i}"): n for i, (p, n) in enumerate(zip(params, norms))}

    def backward_norms(self, scale: float | None) -> dict[str, float]:
        """Per parameter, the norm of the gradient backward made (divided by the GradScaler's ``scale``)."""
        if not self.backward:
            return {}
        values = torch.stack(list(self.backward.values())).tolist()
        return {n: v / scale if scale else v for n, v in zip(self.backward, values)}


def _total(norms: dict[str, float]) -> float | None:
    return math.sqrt(sum(v * v for v in norms.values())) if norms else None


def _nonfinite_state(state: Any) -> list[str]:
    bad = [f"param {n}" for n, p in state.model.named_parameters() if not torch.isfinite(p.detach()).all()]
    names = {id(p): n for n, p in state.model.named_parameters()}
    for p, st in state.optimizer.state.items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all():
                bad.append(f"optimizer {k} of {names.get(id(p), '?')}")
    return bad


def bisect_steps(bundle: Bundle, *, device: str | None = None, code: Any = None,
                 rules: StepRules | None = None) -> dict[str, Any]:
    """Replay with per-step instrumentation; report ``first_bad_step``, ``reason`` and ``per_step``.

    Each row's ``grad_norm`` and ``top_grads`` are the gradients as backward left them (before clipping),
    ``stepped_grad_norm`` what the optimizer step received, ``clipped`` whether that was less, and ``lr`` the
    learning rate of each param group when the optimizer stepped (at step entry when it did not step).
    """
    rules = rules or StepRules()
    history = [h for h in bundle.run.get("history", []) if h["step"] < bundle.steps[0]]
    losses = [h["loss"] for h in history if isinstance(h.get("loss"), float) and math.isfinite(h["loss"])]
    prior_losses = list(losses)
    # The recorder's norms are read at the optimizer step: comparable only where the loop does not clip.
    recorded_gnorms = [h["grad_norm"] for h in history if isinstance(h.get("grad_norm"), float)
                       and math.isfinite(h["grad_norm"])]
    gnorms: list[float] = []
    per_step: list[dict[str, Any]] = []
    first_bad = reason = None
    streak = 0
    reproduced = False
    with Session(bundle, device=device, code=code) as s:
        s.restore()
        state = s.state
        assert state is not None
        probe = _GradProbe(state)
        try:
            for inp in s.inputs():
                probe.reset()
                scale_before = state.scaler.get_scale() if state.scaler_enabled() else None
                entry_lrs = [float(g["lr"]) for g in state.optimizer.param_groups]
                out = s.run([inp], snapshot=None, restore=False)
                reproduced = reproduced or out.same
                row = _row(inp.step, out, probe, state, scale_before, entry_lrs)
                if not per_step and not row["clipped"]:
                    gnorms = recorded_gnorms
                skipped = row["scaler_skipped"]
                streak = streak + 1 if skipped else 0
                why = _judge(row, losses, gnorms, streak, rules)
                row["bad"] = why
                per_step.append(row)
                if why and first_bad is None:
                    first_bad, reason = inp.step, why
                loss, gnorm = row["loss"], row["grad_norm"]
                if loss is not None and math.isfinite(loss):
                    losses.append(loss)
                if gnorm is not None and math.isfinite(gnorm):
                    gnorms.append(gnorm)
                if out.failure is not None:
                    break
        finally:
            probe.remove()
    departed = _departure(per_step, prior_losses, rules)
    if departed is not None and (first_bad is None or departed[0] < first_bad):
        first_bad, reason = departed
        row = next(r for r in per_step if r["step"] == first_bad)
        row["bad"] = row["bad"] or reason
    return {"first_bad_step": first_bad, "reason": reason, "failure_step": bundle.failure.step,
            "reproduced": reproduced, "per_step": per_step}


def _row(step: int, out: Any, probe: _GradProbe, state: Any, scale_before: float | None,
         entry_lrs: list[float]) -> dict[str, Any]:
    stepped = probe.stepped or {}
    stepped_norm = _total(stepped)
    scale = state.scaler.get_scale() if state.scaler_enabled() else None
    skipped = scale is not None and scale_before is not None and scale < scale_before
    # A step the GradScaler skipped overflowed on purpose (it lowers the scale and goes on): its gradients, which
    # backward scaled up, do not count, as the recorder does not count them.
    norms = stepped if skipped else probe.backward_norms(scale_before) or stepped
    gnorm = _total(norms)
    clipped = (gnorm is not None and stepped_norm is not None and math.isfinite(gnorm)
               and stepped_norm < gnorm * (1 - 1e-3))
    return {"step": step, "loss": out.losses.get(step), "grad_norm": gnorm, "stepped_grad_norm": stepped_norm,
            "clipped": clipped, "lr": probe.lrs if probe.lrs is not None else entry_lrs, "scale": scale,
            "scaler_skipped": skipped,
            "top_grads": sorted(norms.items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else -math.inf)[:5],
            "nonfinite_state": _nonfinite_state(state)[:10],
            "failure": out.failure.describe() if out.failure else None}


def _departure(rows: list[dict[str, Any]], prior_losses: list[float],
               rules: StepRules) -> tuple[int, str] | None:
    """The first step where the loss or the gradient norm jumped above the steps before it and stayed up.

    Judged in hindsight over the replayed window: a step whose value is over ``factor`` x the largest of the
    ``departure_window`` steps before it, with every later value up to the failure over that level too (a
    non-finite one counts as over). A single noisy step that comes back down is no departure.
    """
    found: list[tuple[int, str]] = []
    for key, factor, what, prior in (("loss", rules.loss_departure, "loss", prior_losses),
                                     ("grad_norm", rules.norm_departure, "gradient norm (before clipping)", [])):
        values: list[float | None] = [r[key] for r in rows]
        for i, v in enumerate(values):
            if v is None or not math.isfinite(v):
                continue
            before = [x for x in [*prior, *values[:i]] if x is not None and math.isfinite(x)]
            before = before[-rules.departure_window:]
            if not before or max(before) <= 0:
                continue
            level = factor * max(before)
            if v > level and all(x is None or not math.isfinite(x) or x > level for x in values[i + 1:]):
                found.append((rows[i]["step"],
                              f"{what} departed: {v:.3g} after {_listed(before)}, over {factor:g} x the largest, "
                              f"and it never came back below {level:.3g} before the failure"))
                break
    return min(found, key=lambda f: f[0]) if found else None  # the loss first, on the same step


def _listed(values: list[float]) -> str:
    return ", ".join(f"{x:.3g}" for x in values)


def _judge(row: dict[str, Any], losses: list[float], gnorms: list[float], streak: int, rules: StepRules) -> str | None:
    g, loss = row["grad_norm"], row["loss"]
    if g is not None and not math.isfinite(g):
        worst = next((n for n, v in row["top_grads"] if not math.isfinite(v)), "?")
        return f"non-finite gradient norm (first: {worst})"
    if row["nonfinite_state"]:
        return "non-finite " + row["nonfinite_state"][0]
    if g is not None and len(gnorms) >= rules.min_history:
        med = statistics.median(gnorms[-50:])
        if med > 0 and g > rules.explode_factor * med:
            return f"gradient norm exploded: {g:.3g} > {rules.explode_factor:g} x median {med:.3g}"
    if streak >= rules.skip_streak:
        return f"GradScaler skipped {streak} steps in a row (scale {row['scale']})"
    if loss is not None and not math.isfinite(loss):
        return f"non-finite loss ({loss})"
    if loss is not None and len(losses) >= rules.min_history:
        med = statistics.median(losses[-50:])
        if med > 0 and loss > rules.spike_factor * med:
            return f"loss spike: {loss:.3g} > {rules.spike_factor:g} x median {med:.3g}"
    if row["failure"]:
        return row["failure"]
    return None


def format_steps(d: dict[str, Any]) -> str:
    rows = d["per_step"]
    clipping = any(r.get("clipped") for r in rows)
    stepped = f" {'stepped':>10}" if clipping else ""
    lines = [f"{'step':>8} {'loss':>12} {'grad norm':>12}{stepped} {'lr':>10} {'scale':>9}  top grads / notes"]
    for r in rows:
        lr = ",".join(f"{x:.3g}" for x in r["lr"])
        top = ", ".join(f"{n} {v:.3g}" for n, v in r["top_grads"][:5])
        mark = "  <-- " + r["bad"] if r["bad"] else ""
        clip = f" {_num(r.get('stepped_grad_norm')) if r.get('clipped') else '-':>10}" if clipping else ""
        lines.append(f"{r['step']:>8} {_num(r['loss']):>12} {_num(r['grad_norm']):>12}{clip} {lr:>10} "
                     f"{_num(r['scale']):>9}  {top}{mark}")
    if clipping:
        lines.append("grad norm: the gradients as backward made them, before clipping; stepped: the norm the "
                     "optimizer step received (clipped); lr: the rate that optimizer step used")
    if d["first_bad_step"] is None:
        lines.append("no step looked bad before the failure")
    else:
        lines.append(f"first bad step: {d['first_bad_step']} ({d['reason']}); the failure fired at step "
                     f"{d['failure_step']}")
    return "\n".join(lines)


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"
