"""``reprokit bisect steps``: the first step at which something went bad, often before the NaN loss.

The window is replayed one step at a time with instrumentation: global and
per-parameter gradient norms (read in an optimizer step pre-hook, so with a
GradScaler they are the unscaled gradients of the steps it let through), a
finiteness check of every parameter and every optimizer state tensor after the
step, each param group's learning rate, and the scaler's scale.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch

from reprokit.bundle import Bundle
from reprokit.replay import Session


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


class _GradProbe:
    def __init__(self, state: Any):
        self.names = {id(p): n for n, p in state.model.named_parameters()}
        self.norms: dict[str, float] | None = None
        self.handle = state.optimizer.register_step_pre_hook(self._hook)

    def _hook(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        if params:
            with torch.no_grad():
                norms = torch.stack([torch.linalg.vector_norm(p.grad.detach().float()) for p in params]).tolist()
            self.norms = {self.names.get(id(p), f"param{i}"): n for i, (p, n) in enumerate(zip(params, norms))}


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
    """Replay with per-step instrumentation; report ``first_bad_step``, ``reason`` and ``per_step``."""
    rules = rules or StepRules()
    history = [h for h in bundle.run.get("history", []) if h["step"] < bundle.steps[0]]
    losses = [h["loss"] for h in history if isinstance(h.get("loss"), float) and math.isfinite(h["loss"])]
    gnorms = [h["grad_norm"] for h in history if isinstance(h.get("grad_norm"), float)
              and math.isfinite(h["grad_norm"])]
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
                probe.norms = None
                scale_before = state.scaler.get_scale() if state.scaler_enabled() else None
                lrs = [g["lr"] for g in state.optimizer.param_groups]
                out = s.run([inp], snapshot=None, restore=False)
                reproduced = reproduced or out.same
                norms: dict[str, float] = probe.norms or {}
                gnorm = math.sqrt(sum(v * v for v in norms.values())) if norms else None
                scale = state.scaler.get_scale() if state.scaler_enabled() else None
                skipped = scale is not None and scale_before is not None and scale < scale_before
                streak = streak + 1 if skipped else 0
                loss = out.losses.get(inp.step)
                bad_state = _nonfinite_state(state)
                row = {"step": inp.step, "loss": loss, "grad_norm": gnorm, "lr": lrs, "scale": scale,
                       "scaler_skipped": skipped,
                       "top_grads": sorted(norms.items(), key=lambda kv: -kv[1] if math.isfinite(kv[1]) else -math.inf)
                       [:5] if norms else [],
                       "nonfinite_state": bad_state[:10],
                       "failure": out.failure.describe() if out.failure else None}
                why = _judge(row, losses, gnorms, streak, rules)
                row["bad"] = why
                per_step.append(row)
                if why and first_bad is None:
                    first_bad, reason = inp.step, why
                if loss is not None and math.isfinite(loss):
                    losses.append(loss)
                if gnorm is not None and math.isfinite(gnorm):
                    gnorms.append(gnorm)
                if out.failure is not None:
                    break
        finally:
            probe.handle.remove()
    return {"first_bad_step": first_bad, "reason": reason, "failure_step": bundle.failure.step,
            "reproduced": reproduced, "per_step": per_step}


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
    lines = [f"{'step':>8} {'loss':>12} {'grad norm':>12} {'lr':>10} {'scale':>9}  top grads / notes"]
    for r in d["per_step"]:
        lr = ",".join(f"{x:.3g}" for x in r["lr"])
        top = ", ".join(f"{n} {v:.3g}" for n, v in r["top_grads"][:5])
        mark = "  <-- " + r["bad"] if r["bad"] else ""
        lines.append(f"{r['step']:>8} {_num(r['loss']):>12} {_num(r['grad_norm']):>12} {lr:>10} "
                     f"{_num(r['scale']):>9}  {top}{mark}")
    if d["first_bad_step"] is None:
        lines.append("no step looked bad before the failure")
    else:
        lines.append(f"first bad step: {d['first_bad_step']} ({d['reason']}); the failure fired at step "
                     f"{d['failure_step']}")
    return "\n".join(lines)


def _num(x: Any) -> str:
    return "-" if x is None else f"{x:.4g}"
