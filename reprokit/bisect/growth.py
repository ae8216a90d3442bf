"""Were the values already out of range before the op that went non-finite? And where did they grow?

An LR that is too high makes the weights, then the activations, grow step after step until some op overflows:
often a LayerNorm, whose variance squares its input (float32 cannot square 2.7e20). That op made the first NaN,
but it is not the cause, and a repro of it shows nothing a user can fix. So while ``bisect layers`` replays the
window up to the failing step, :class:`Growth` keeps each parameter's norm after every step's update and what each
module received in the window's first step; :meth:`Growth.verdict` then says whether the culprit's inputs or
weights were already out of range (beyond what their dtype can square, or ``GROWTH_FACTOR`` x what the module
received in the window's first step) and which parameter grew, from which step on.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from reprokit import pytree
from reprokit.detect import current_step

GROWTH_FACTOR = 1e4
"""An input this many times larger than what the same module received in the window's first step is out of range."""
PAST = 10.0
"""A parameter "grew" at the first step whose update took its norm past this many times its norm at the window's
start."""
SQUARE_LIMITS = {dtype: math.sqrt(torch.finfo(dtype).max) for dtype in (torch.float32, torch.float64, torch.bfloat16)}
"""Values above these cannot be squared in their dtype (a variance, a norm, a dot product overflows). float16 is
not listed: its limit (256) is an ordinary activation, and its overflow is a precision question (``bisect
precision``), not a sign that the values grew."""


class Growth:
    """Per-parameter norms after each step of a replay, and each module's largest input in its first step."""

    def __init__(self, state: Any, first_step: int):
        self.first_step = first_step
        self.model = state.model
        self.start: dict[str, float] | None = None
        """Each parameter's norm when the window's first step began."""
        self.after: dict[int, dict[str, float]] = {}
        """Step -> each parameter's norm after that step's optimizer update."""
        self.typical: dict[str, float] = {}
        """Module -> the largest |value| of its floating inputs in the window's first step."""
        self.handles = [state.optimizer.register_step_post_hook(self._stepped)]
        for name, mod in state.model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(self._received(name or "<model>")))

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    def _norms(self) -> dict[str, float]:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            values = [torch.linalg.vector_norm(p.detach(), dtype=torch.float64) for p in params.values()]
            return dict(zip(params, torch.stack(values).tolist())) if values else {}

    def _stepped(self, *_: Any) -> None:
        running = current_step()
        if running is not None:
            self.after[running[0]] = self._norms()

    def _received(self, name: str) -> Any:
        def hook(mod: torch.nn.Module, inputs: Any) -> None:
            running = current_step()
            if running is None or running[0] != self.first_step:
                return
            if self.start is None:  # the outermost module's hook fires first, before anything in the step ran
                self.start = self._norms()
            largest = _abs_max(inputs)
            if largest is not None:
                self.typical[name] = max(self.typical.get(name, 0.0), largest)
        return hook

    def verdict(self, first: dict[str, Any], op: dict[str, Any] | None, dtype: torch.dtype | None,
                failing_step: int) -> dict[str, Any] | None:
        """Whether ``first`` (the culprit's frame: module, phase, inputs, weights) received values already out of
        range; None when it did not. ``op`` is the op's detail (its inputs' ranges), ``dtype`` the inputs' dtype."""
        limit = SQUARE_LIMITS.get(dtype) if dtype is not None else None
        # A value at the dtype's own edge is a fill (an attention mask of finfo.min, Hugging Face's convention), not a
        # value that grew: it is no evidence of range.
        edge = torch.finfo(dtype).max / 2 if dtype is not None and dtype.is_floating_point else FILL_EDGE
        x = max([s["abs_max"] for s in (first.get("inputs"), (op or {}).get("inputs"))
                 if s and s.get("abs_max") is not None and s["abs_max"] < edge], default=None)
        w = (first.get("weights") or {}).get("abs_max")
        typical = self.typical.get(first["module"]) if first["phase"] == "forward" else None
        why = []
        what = "gradient it received" if first["phase"] == "backward" else "input"
        grew = self.grew(failing_step)
        if x is not None and limit is not None and x > limit and (grew is not None or (typical and x > typical)):
            why.append(f"its {what} reached {x:.3g}, beyond what {_name(dtype)} can square ({limit:.3g})")
        elif x is not None and typical and x > GROWTH_FACTOR * typical:
            why.append(f"its {what} reached {x:.3g}, {x / typical:.2g} x the {typical:.3g} it received at step "
                       f"{self.first_step}")
        if w is not None and limit is not None and w > limit:
            why.append(f"its weights reached {w:.3g}, beyond what {_name(dtype)} can square ({limit:.3g})")
        if not why:
            return None
        return {"module": first["module"], "phase": first["phase"], "input_abs_max": x, "weights_abs_max": w,
                "typical": typical, "typical_step": self.first_step if typical else None,
                "dtype": _name(dtype), "limit": limit, "why": why, "grew": grew, "failing_step": failing_step,
                "summary": _summary(first, op, why, grew, failing_step)}

    def grew(self, failing_step: int) -> dict[str, Any] | None:
        """The parameter whose norm grew the most over the window (by at least ``PAST``): from what, to what, and
        the step whose update first took it past ``PAST`` x its start; None when none grew that much."""
        steps = sorted(s for s in self.after if s < failing_step)
        start = self.start
        if not steps or start is None:
            return None
        last = self.after[steps[-1]]
        ratios = {n: last[n] / start[n] for n in last if start.get(n, 0) > 0 and math.isfinite(last[n])}
        if not ratios:
            return None
        name = max(ratios, key=lambda n: ratios[n])
        if ratios[name] < PAST:
            return None
        at = next(s for s in steps if self.after[s][name] > PAST * start[name])
        total = (math.sqrt(sum(v * v for v in start.values())), math.sqrt(sum(v * v for v in last.values())))
        return {"parameter": name, "norm_start": start[name], "norm_before_failure": last[name],
                "factor": ratios[name], "from_step": self.first_step, "past_step": at, "past": PAST,
                "all_params_norm_start": total[0], "all_params_norm_before_failure": total[1]}


FILL_EDGE = torch.finfo(torch.float32).max / 2
"""Values at or past this are fills (``finfo.min`` masks), not computed ones, when the dtype is not known."""


def _abs_max(obj: Any) -> float | None:
    """The largest finite |value| of the floating tensors in ``obj`` (an attention mask's -inf is no size)."""
    with torch.no_grad():
        peaks = [torch.where(torch.isfinite(t), t.detach().abs(), 0).amax().float() for _, t in pytree.leaves(obj)
                 if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()]
        return float(torch.stack([p.to(peaks[0].device) for p in peaks]).max()) if peaks else None


def _name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _summary(first: dict[str, Any], op: dict[str, Any] | None, why: list[str], grew: dict[str, Any] | None,
             failing_step: int) -> str:
    made = f"op aten.{op['op']} in " if op and op.get("op") else ""
    return (f"the values were already out of range before {made}{first['module']} ({first['class']}, "
            f"{first['phase']}): {'; '.join(why)}; it overflowed on values that grew before it, so it is where the "
            f"NaN appeared, not its cause. {grew_line(grew, failing_step)}")


def grew_line(grew: dict[str, Any] | None, failing_step: int) -> str:
    """Where the values grew, in words, with what to run next."""
    if grew is None:
        return ("No parameter grew tenfold within the window: the values grew before it, or came with the batch "
                "(`reprokit inspect --batch`); `reprokit bisect steps` shows the steps of the window")
    return (f"They grew: parameter {grew['parameter']}'s norm went from {grew['norm_start']:.3g} at step "
            f"{grew['from_step']} to {grew['norm_before_failure']:.3g} before step {failing_step} "
            f"(x{grew['factor']:.3g}; all parameters {grew['all_params_norm_start']:.3g} -> "
            f"{grew['all_params_norm_before_failure']:.3g}), past {grew['past']:g}x with the update of step "
            f"{grew['past_step']}; `reprokit bisect steps` shows the loss, gradient norm and LR of those steps")
