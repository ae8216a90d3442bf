"""``reprokit bisect layers``: which module (and which op inside it) first produced a non-finite value.

The window is replayed up to the failing step; that step then runs with a
forward and a full backward hook on every module, recording, in execution
order, each module's input/output/weight ranges. The first module whose
forward output (else backward gradient) is non-finite is the culprit; the
step is then run once more from the same state with a ``TorchDispatchMode``
that watches only while the culprit runs and names the first aten op whose
output is non-finite. For exception failures, the module whose forward raised
and the shapes/dtypes it received are reported instead.

Module hooks only see module boundaries: a NaN the step function's own loss
expression makes (a 0/0 outside every module) reaches the modules only through
backward. So the step also runs once under :func:`reprokit.origin.watch_step`,
and ``origin`` names the first op that made the non-finite value, wherever it
ran (module, or the step function's file:line), as the shrinker checks it.

A model compiled with ``torch.compile`` runs its modules inside one graph, where
module hooks do not fire (localisation would stop at ``_orig_mod``). When the
model holds a compiled module, the whole bisection runs the steps eagerly
(``torch.compiler.set_stance("force_eager")``, the compiled module's own Python
code) and says so in ``eager``; module paths are then those inside it
(``_orig_mod.block.lin``). Eager numerics may differ from the compiled kernels':
a failure that only the compiled code makes does not show there, and the result
says the failing step passed.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from reprokit import pytree
from reprokit.bisect.growth import Growth, grew_line
from reprokit.bundle import Bundle
from reprokit.origin import OriginWatcher, watch_step
from reprokit.origin import value_stats as _stats
from reprokit.replayer import Session
from reprokit.shrink.batch import batch_size
from reprokit.signature import FailureKind


def _shapes(obj: Any) -> list[str]:
    return [f"{p}: {t.dtype}{list(t.shape)}".replace("torch.", "") for p, t in pytree.leaves(obj)
            if isinstance(t, torch.Tensor)]


def _float_dtype(obj: Any) -> torch.dtype | None:
    """The dtype of the first floating tensor in ``obj``."""
    return next((t.dtype for _, t in pytree.leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()),
                None)


def _out_of_range(mod: torch.nn.Module, inputs: Any) -> dict[str, Any] | None:
    """For an ``nn.Embedding``: the first id it received outside its table, where, and the table's size."""
    if not isinstance(mod, torch.nn.Embedding) or not inputs or not isinstance(inputs[0], torch.Tensor):
        return None
    ids = inputs[0]
    if ids.is_floating_point() or ids.is_complex() or not ids.numel():
        return None
    bad = (ids < 0) | (ids >= mod.num_embeddings)
    count = int(bad.sum())
    if not count:
        return None
    at = [int(i) for i in torch.nonzero(bad)[0]]
    return {"id": int(ids[tuple(at)]), "at": at, "count": count, "num_embeddings": mod.num_embeddings}


@dataclass
class _Tracer:
    model: torch.nn.Module
    keep: int
    frames: deque = field(default_factory=lambda: deque(maxlen=400))
    first: dict[str, Any] | None = None
    stack: list[tuple[str, list[str]]] = field(default_factory=list)
    recorded: int = 0
    """Frames recorded in all (``frames`` keeps the last 400)."""
    forward_from: int = 0
    """``recorded`` when the outermost forward now running began: the frames of the forward that raised."""
    out_of_range: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per embedding module that received ids outside its table in the step: the first one (see _out_of_range)."""
    backward: list[tuple[str, list[str]]] = field(default_factory=list)
    """Modules whose backward is running: their backward pre hook fired, their backward hook not yet."""
    handles: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name, mod in self.model.named_modules():
            name = name or "<model>"
            self.handles.append(mod.register_forward_pre_hook(self._pre(name)))
            self.handles.append(mod.register_forward_hook(self._post(name)))
            self.handles.append(mod.register_full_backward_pre_hook(self._back_pre(name)))
            self.handles.append(mod.register_full_backward_hook(self._back(name)))

    def _pre(self, name: str) -> Any:
        def hook(mod: torch.nn.Module, inputs: Any) -> None:
            if not self.stack:  # a new forward (with accumulation, after the last micro-batch's backward)
                self.forward_from = self.recorded
            self.stack.append((name, _shapes(inputs)))
            bad = _out_of_range(mod, inputs)
            if bad is not None:
                self.out_of_range.setdefault(name, bad)
        return hook

    def _post(self, name: str) -> Any:
        def hook(mod: torch.nn.Module, inputs: Any, output: Any) -> None:
            if self.stack:
                self.stack.pop()
            self._record(name, mod, "forward", inputs, output)
        return hook

    def _back_pre(self, name: str) -> Any:
        def hook(mod: torch.nn.Module, grad_output: Any) -> None:
            self.backward.append((name, _shapes(grad_output)))
        return hook

    def _back(self, name: str) -> Any:
        def hook(mod: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
            for i in range(len(self.backward) - 1, -1, -1):
                if self.backward[i][0] == name:
                    del self.backward[i]
                    break
            self._record(name, mod, "backward", grad_output, grad_input)
        return hook

    def _record(self, name: str, mod: torch.nn.Module, phase: str, inputs: Any, outputs: Any) -> None:
        frame: dict[str, Any] = {"module": name, "class": type(mod).__name__, "phase": phase, "inputs": _stats(inputs),
                 "outputs": _stats(outputs),
                 "weights": _stats([p for p in mod.parameters(recurse=False)])}
        self.frames.append(frame)
        self.recorded += 1
        out = frame["outputs"]
        if self.first is None and out is not None and out["nonfinite"]:
            self.first = {**frame, "index": len(self.frames) - 1, "dtype": _float_dtype(inputs),
                          "inputs_already_nonfinite": bool(frame["inputs"] and frame["inputs"]["nonfinite"])}
            self.first_frames = list(self.frames)[-self.keep - 1:-1]

    def close(self) -> None:
        for h in self.handles:
            h.remove()


EAGER_NOTE = ("the model is compiled (torch.compile): bisect ran the steps eagerly, the compiled module's own Python "
               "code, so that module hooks see inside it")


def compiled_modules(model: torch.nn.Module) -> list[str]:
    """Paths of the modules in ``model`` that ``torch.compile`` wrapped (``<model>`` for the model itself)."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # a torch without dynamo compiles nothing
        return []
    return [name or "<model>" for name, m in model.named_modules() if isinstance(m, OptimizedModule)]


def _eager_if(compiled: bool) -> Any:
    """Run compiled code eagerly while bisecting a compiled model."""
    if not compiled:
        return contextlib.nullcontext()
    if hasattr(torch.compiler, "set_stance"):
        return torch.compiler.set_stance("force_eager")
    from torch._dynamo import config  # torch < 2.6: no stances; dynamo disabled runs compiled modules' Python code

    return config.patch(disable=True)


def bisect_layers(bundle: Bundle, *, device: str | None = None, code: Any = None, keep: int = 20) -> dict[str, Any]:
    """Localise the failing step's first non-finite module and op (or the module that raised).

    A compiled model (``torch.compile``) is bisected eagerly: ``result["eager"]`` lists the compiled modules and
    ``result["note"]`` says so.
    """
    with Session(bundle, device=device, code=code) as s:
        assert s.state is not None
        compiled = compiled_modules(s.state.model)
        with _eager_if(bool(compiled)):
            result = _bisect(s, keep)
        if compiled:
            result["eager"] = compiled
            result["note"] = EAGER_NOTE + (f"; {result['note']}" if result.get("note") else "")
        return result


def _bisect(s: Session, keep: int) -> dict[str, Any]:
    inputs = s.inputs()
    assert s.state is not None
    # The window's steps before the failing one: how the parameters (and the values each module receives) grew.
    growth = Growth(s.state, inputs[0].step)
    try:
        before = s.advance(inputs[:-1]) if len(inputs) > 1 else s.snapshot
    finally:
        growth.close()
    if before is None:
        return {"first_nonfinite": None, "frames": [], "raised_in": None, "reproduced": False,
                "note": "the window failed before its last step; shrink or replay it first"}
    tracer = _Tracer(s.state.model, keep)
    try:
        with warnings.catch_warnings():
            # Full backward hooks warn when a module's inputs need no grad (the first layer): expected here.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            # A module returning an object (a Hugging Face ModelOutput) gets no backward hook: its forward is traced.
            warnings.filterwarnings("ignore", message="For backward hooks to be called")
            out = s.run(inputs[-1:], before)
    finally:
        tracer.close()
    result: dict[str, Any] = {"failure": out.failure.describe() if out.failure else None, "reproduced": out.same,
                              "first_nonfinite": None, "frames": [], "raised_in": None, "origin": None,
                              "already_out_of_range": None}
    if out.failure is not None and out.failure.kind == FailureKind.EXCEPTION and (tracer.stack or tracer.backward):
        # Raised in a module's forward, else in a module's backward (innermost first; a module whose
        # inputs need no grad has its backward hook fire early, so it is not seen there).
        phase = "forward" if tracer.stack else "backward"
        name, shapes = (tracer.stack or tracer.backward)[-1]
        result["raised_in"] = {"module": name, "class": type(s.state.model.get_submodule(
            "" if name == "<model>" else name)).__name__, "phase": phase, "received": shapes,
            "exception": f"{out.failure.exc_type}: {out.failure.message}",
            "out_of_range": tracer.out_of_range.get(name) if phase == "forward" else None}
        # Raised in a forward: the frames of that forward only, not the last micro-batch's backward before it.
        since = min(keep, tracer.recorded - tracer.forward_from) if phase == "forward" else keep
        result["frames"] = list(tracer.frames)[-since:] if since else []
        return result
    if out.failure is not None and out.failure.kind != FailureKind.EXCEPTION:
        origin = watch_step(s, inputs[-1], before, batch_size(inputs[-1].batch))[1]
        result["origin"] = origin.to_json() if origin else None
    if tracer.first is None:
        result["frames"] = list(tracer.frames)[-keep:]
        return result
    first = tracer.first
    result["frames"] = tracer.first_frames + [{k: first[k] for k in ("module", "class", "phase", "inputs",
                                                                       "outputs", "weights")}]
    op = _find_op(s, inputs[-1:], before, first["module"], first["phase"])
    origin = result["origin"]
    # Inputs holding non-finite values (an attention mask's -inf) did not bring the failure when the origin check saw
    # the value made inside this module, in this phase, from inputs free of its kind.
    made_inside = bool(origin and origin.get("created") and origin.get("phase") == first["phase"]
                       and origin.get("module") is not None
                       and (first["module"] == "<model>" or origin["module"] == first["module"]
                            or origin["module"].startswith(first["module"] + ".")))
    result["first_nonfinite"] = {"module": first["module"], "class": first["class"], "phase": first["phase"],
                                 "op": op["op"] if op else None, "op_detail": op,
                                 "inputs_already_nonfinite": first["inputs_already_nonfinite"],
                                 "made_inside": made_inside}
    if not first["inputs_already_nonfinite"]:
        result["already_out_of_range"] = growth.verdict(first, op, first["dtype"], inputs[-1].step)
    if origin and origin.get("created") and origin.get("module") is None:
        # Made by the step function's own code: the module hooks saw it only later, arriving in backward.
        result["outside_every_module"] = {"site": origin.get("site"), "op": origin.get("op"),
                                          "phase": origin.get("phase")}
    return result


def _find_op(s: Session, steps: list, before: Any, module: str, phase: str) -> dict[str, Any] | None:
    """Run the step again from the same state, watching aten ops only inside ``module``'s forward."""
    assert s.state is not None
    mod = s.state.model if module == "<model>" else s.state.model.get_submodule(module)
    mode = OriginWatcher(active=False)

    def on(*_: Any) -> None:
        mode.active = True

    def off(*_: Any) -> None:
        mode.active = False

    handles = [mod.register_forward_pre_hook(on), mod.register_forward_hook(off)] if phase == "forward" else \
        [mod.register_full_backward_pre_hook(on), mod.register_full_backward_hook(off)]
    try:
        with mode, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            s.run(steps, before)
    finally:
        for h in handles:
            h.remove()
    return mode.first_nonfinite


def format_layers(d: dict[str, Any]) -> str:
    lines = []
    if d.get("note"):
        lines.append(f"note: {d['note']}")
    if d.get("origin"):
        lines.append(f"origin: {d['origin']['summary']}")
    if d.get("raised_in"):
        r = d["raised_in"]
        back = r.get("phase") == "backward"
        lines.append(f"raised in module {r['module']} ({r['class']}){' in backward' if back else ''}: "
                     f"{r['exception']}")
        lines.append(("  the gradient it received: " if back else "  it received: ") + "; ".join(r["received"]))
        bad = r.get("out_of_range")
        if bad:
            lines.append(f"  id {bad['id']} at {bad['at']} is outside its table of {bad['num_embeddings']} "
                         f"(num_embeddings; valid ids 0..{bad['num_embeddings'] - 1}); "
                         f"{bad['count']} id{'' if bad['count'] == 1 else 's'} out of range")
    elif d.get("outside_every_module"):
        o, f = d["outside_every_module"], d["first_nonfinite"]
        lines.append(f"first non-finite: made by the step function, outside every module, at {o['site'] or '?'} "
                     f"({o['op']}, {o['phase']}); no module is to blame")
        lines.append(f"  the modules saw it only afterwards: {f['module']} ({f['class']}) in {f['phase']}")
    elif d.get("first_nonfinite"):
        f = d["first_nonfinite"]
        lines.append(f"first non-finite: {f['module']} ({f['class']}), {f['phase']}"
                     + (f", op aten.{f['op']}" if f["op"] else ""))
        if f.get("made_inside") and d.get("origin"):
            o = d["origin"]
            held = "; its inputs held other non-finite values (an attention mask's -inf, say)" \
                if f["inputs_already_nonfinite"] else ""
            lines.append(f"  the {o['value']} was made inside it, by {o['op']}, from inputs free of {o['value']}{held}")
        elif f["inputs_already_nonfinite"]:
            lines.append("  its inputs were already non-finite: look at the data (or a module without hooks)")
        r = d.get("already_out_of_range")
        if r:
            lines.append(f"  not the cause: the values were already out of range before this op: {'; '.join(r['why'])}")
            lines.append("  it overflowed on values that grew before it: it is where the NaN appeared, not why")
            lines.append(f"  {grew_line(r['grew'], r['failing_step'])}")
    else:
        lines.append("no module produced a non-finite value in the failing step")
    frames = d.get("frames", [])
    if not frames:  # nothing ran to completion before it (the first module raised): no table to show
        return "\n".join(lines)
    # Columns as wide as their longest entry: module paths and class names are never cut.
    wm = max([len("module"), *(len(fr["module"]) for fr in frames)]) + 2
    wc = max([len("class"), *(len(fr["class"]) for fr in frames)]) + 2
    lines.append(f"{'module':<{wm}}{'class':<{wc}}{'phase':<9}{'in |min|..|max| (nonfinite)':<34}"
                 "out |min|..|max| (nonfinite)")
    for fr in frames:
        lines.append(f"{fr['module']:<{wm}}{fr['class']:<{wc}}{fr['phase']:<9}{_span(fr['inputs']):<34}"
                     f"{_span(fr['outputs'])}")
    return "\n".join(lines)


def _span(st: dict[str, Any] | None) -> str:
    if not st:
        return "-"
    lo = "-" if st["abs_min"] is None else f"{st['abs_min']:.3g}"
    hi = "-" if st["abs_max"] is None else f"{st['abs_max']:.3g}"
    return f"{lo}..{hi} ({st['nonfinite']})"
