"""A module-level repro written by ``reprokit extract``: one module, its weights, the inputs it received.

This file is copied into an extract's code snapshot as ``rk_extract.py``; replay imports ``build``
and ``train_step`` from it like from any project. ``build(config)`` makes the module from its class
(the snapshot's copy of the project, or torch.nn.modules; refs are vetted like every ref a bundle holds, so a
config naming the standard library or an installed package makes the bundle invalid) without calling its ``__init__``:
plain attributes, parameters and buffers are set from ``config`` and the snapshot fills in their
values. ``train_step`` runs the module's forward on the recorded inputs (and, for a backward
failure, backward with the recorded gradient) and raises ``FloatingPointError`` naming the first
non-finite value, or lets the module's own exception through. An extract narrowed to one op (its
module was too large to carry) runs :class:`AtenOp`, that op on its saved inputs.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

import reprokit
from reprokit.code import resolve_project
from reprokit.errors import BundleError
from reprokit.extract_op import dtype_of, op_overload

TORCH_MODULES = "torch.nn.modules."
"""The one namespace outside the code snapshot that an extract's class may come from: torch's own layers."""


def _refused(field: str, value: Any, why: str) -> BundleError:
    return BundleError(f"run.json: config.{field} = {value!r} {why}. An extract runs only the classes of its code "
                       "snapshot, torch's layers (torch.nn.modules) and pure tensor ops, so this bundle is invalid and "
                       "nothing it names was imported or run. Extract it again from the source bundle.",
                       [{"file": "run.json", "problem": f"config.{field} {why}"}])


def _class(ref: Any, field: str) -> type[torch.nn.Module]:
    """The module class ``ref`` names: vetted like every ref a bundle holds, before anything is imported.

    A class of the code snapshot goes through :func:`reprokit.code.resolve_project` (never the standard library,
    reprokit or an installed package); a torch layer must be a ``torch.nn.Module`` defined in ``torch.nn.modules``,
    looked up among the modules torch already imported (nothing is imported for it).
    """
    module = ref.get("module") if isinstance(ref, dict) else None
    if isinstance(module, str) and module.startswith(TORCH_MODULES) and set(ref) == {"module", "qualname"}:
        obj: Any = sys.modules.get(module)
        qualname = ref["qualname"]
        for part in qualname.split(".") if isinstance(qualname, str) and obj is not None else [""]:
            obj = getattr(obj, part, None) if part.isidentifier() and not part.startswith("_") else None
        if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module) and obj.__module__ == module
                and obj.__qualname__ == qualname):
            raise _refused(field, ref, f"names no torch.nn.Module class of {module}")
        return obj
    obj = resolve_project(ref, field)  # refuses the standard library, reprokit, installed packages: imports nothing
    if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
        raise _refused(field, ref, "names no torch.nn.Module class")
    return obj


def _make(spec: Any, field: str = "module") -> torch.nn.Module:
    if not isinstance(spec, dict) or not {"class", "attrs", "params", "buffers", "children"} <= set(spec):
        raise _refused(field, type(spec).__name__, "is not a module spec (class, attrs, params, buffers, children)")
    cls = _class(spec["class"], f"{field}.class")
    for name in spec["attrs"]:
        if not isinstance(name, str) or name.startswith("_"):
            raise _refused(f"{field}.attrs", name, "is not a public attribute (extract keeps only those)")
    if issubclass(cls, AtenOp):
        try:
            op_overload(spec["attrs"].get("op"))
        except ValueError as e:
            raise _refused(f"{field}.attrs.op", spec["attrs"].get("op"), f"is refused: {e}") from None
        if not isinstance(spec["attrs"].get("call"), str):
            raise _refused(f"{field}.attrs.call", spec["attrs"].get("call"), "is not a JSON string")
    mod = cls.__new__(cls)
    torch.nn.Module.__init__(mod)
    for name, value in spec["attrs"].items():
        mod.__dict__[name] = value
    for name, p in spec["params"].items():
        mod._parameters[name] = None if p is None else torch.nn.Parameter(
            torch.zeros(p["shape"], dtype=dtype_of(p["dtype"])), requires_grad=p["requires_grad"])
    for name, b in spec["buffers"].items():
        mod._buffers[name] = None if b is None else torch.zeros(b["shape"], dtype=dtype_of(b["dtype"]))
    for name, child in spec["children"].items():
        mod._modules[name] = None if child is None else _make(child, f"{field}.children.{name}")
    return mod


def _decode(v: Any, tensors: dict[str, torch.Tensor], device: torch.device) -> Any:
    if isinstance(v, list):
        return [_decode(x, tensors, device) for x in v]
    if isinstance(v, dict):
        if "tensor" in v:
            return tensors[v["tensor"]]
        if "float" in v:
            return float(v["float"])
        if "dtype" in v:
            return dtype_of(v["dtype"])
        if "device" in v:
            return device
    return v


class AtenOp(torch.nn.Module):
    """One aten op as a module: an extract narrowed to the op that made the value (or raised).

    ``op`` names the overload (``aten._softmax.default``); ``call`` holds its arguments as JSON, where
    ``{"tensor": "tK"}`` stands for the K-th tensor given to ``forward``. Only a pure tensor op runs
    (:func:`reprokit.extract_op.refusal`): a config naming ``aten.from_file``, say, makes the bundle invalid.
    """

    op: str
    call: str

    def forward(self, *tensors: torch.Tensor) -> Any:
        spec = json.loads(self.call)
        named = {f"t{i}": t for i, t in enumerate(tensors)}
        device = tensors[0].device if tensors else torch.device("cpu")
        fn = op_overload(self.op)  # a pure tensor op only (build checked it too): never a file, a process
        return fn(*_decode(spec["args"], named, device),
                  **{k: _decode(v, named, device) for k, v in spec["kwargs"].items()})


def build(config: dict[str, Any]) -> reprokit.TrainState:
    model = _make(config["module"])
    params = [p for p in model.parameters()] or [torch.nn.Parameter(torch.zeros(1))]
    # The optimizer never steps: an extract runs one forward (and backward), nothing else.
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(params, lr=0.0))


def _tensors(obj: Any) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _check(what: str, named: list[tuple[str, Any]]) -> None:
    for name, t in named:
        if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
            continue
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            nan = int(torch.isnan(t).sum())
            first = tuple(int(i) for i in torch.nonzero(bad)[0]) if t.dim() else ()
            raise FloatingPointError(f"{what} {name} holds {nan} NaN and {int(bad.sum()) - nan} inf value(s) "
                                     f"of {t.numel()} (first at index {list(first)})")


def train_step(state: reprokit.TrainState, batch: dict[str, Any]) -> torch.Tensor:
    model, phase = state.model, batch["phase"]
    args, kwargs = list(batch["args"]), dict(batch["kwargs"])
    floats = [t for t in _tensors((args, kwargs)) if t.is_floating_point()]
    if phase == "backward":
        for t in floats:
            t.requires_grad_(True)
    with torch.set_grad_enabled(phase == "backward"):
        out = model(*args, **kwargs)
    outs = _tensors(out)
    if phase == "forward":
        _check("the op's output" if isinstance(model, AtenOp) else "the module's output",
               [(f"[{i}]", t) for i, t in enumerate(outs)])
        return torch.zeros(())
    pairs = [(o, g) for o, g in zip(outs, batch["grad_outputs"]) if g is not None and o.requires_grad]
    torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
    _check("the gradient of input", [(f"[{i}]", t.grad) for i, t in enumerate(floats)])
    _check("the gradient of parameter", [(n, p.grad) for n, p in model.named_parameters()])
    model.zero_grad(set_to_none=True)
    return torch.zeros(())
