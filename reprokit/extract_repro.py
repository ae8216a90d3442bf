"""A module-level repro written by ``reprokit extract``: one module, its weights, the inputs it received.

This file is copied into an extract's code snapshot as ``rk_extract.py``; replay imports ``build``
and ``train_step`` from it like from any project. ``build(config)`` makes the module from its class
(imported from the snapshot's copy of the project, or from torch) without calling its ``__init__``:
plain attributes, parameters and buffers are set from ``config`` and the snapshot fills in their
values. ``train_step`` runs the module's forward on the recorded inputs (and, for a backward
failure, backward with the recorded gradient) and raises ``FloatingPointError`` naming the first
non-finite value, or lets the module's own exception through. An extract narrowed to one op (its
module was too large to carry) runs :class:`AtenOp`, that op on its saved inputs.
"""

from __future__ import annotations

import importlib
import json
from typing import Any

import torch

import reprokit


def _class(ref: dict[str, Any]) -> Any:
    obj: Any = importlib.import_module(ref["module"])
    for part in ref["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


def _make(spec: dict[str, Any]) -> torch.nn.Module:
    cls = _class(spec["class"])
    mod = cls.__new__(cls)
    torch.nn.Module.__init__(mod)
    for name, value in spec["attrs"].items():
        mod.__dict__[name] = value
    for name, p in spec["params"].items():
        mod._parameters[name] = None if p is None else torch.nn.Parameter(
            torch.zeros(p["shape"], dtype=getattr(torch, p["dtype"])), requires_grad=p["requires_grad"])
    for name, b in spec["buffers"].items():
        mod._buffers[name] = None if b is None else torch.zeros(b["shape"], dtype=getattr(torch, b["dtype"]))
    for name, child in spec["children"].items():
        mod._modules[name] = None if child is None else _make(child)
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
            return getattr(torch, v["dtype"])
        if "device" in v:
            return device
    return v


class AtenOp(torch.nn.Module):
    """One aten op as a module: an extract narrowed to the op that made the value (or raised).

    ``op`` names the overload (``aten._softmax.default``); ``call`` holds its arguments as JSON, where
    ``{"tensor": "tK"}`` stands for the K-th tensor given to ``forward``.
    """

    op: str
    call: str

    def forward(self, *tensors: torch.Tensor) -> Any:
        spec = json.loads(self.call)
        named = {f"t{i}": t for i, t in enumerate(tensors)}
        device = tensors[0].device if tensors else torch.device("cpu")
        ns, name, overload = (self.op.split(".") + ["default"])[:3]
        fn = getattr(getattr(getattr(torch.ops, ns), name), overload)
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
