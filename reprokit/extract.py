"""``reprokit extract``: the smallest program that shows the bad value, out of a whole bundle.

A bundle carries the whole model and optimizer; a bug report needs one module. ``extract``
localises the failing step like ``bisect layers`` (the module whose forward raised, else the first
module whose output, or gradient in backward, went non-finite from finite inputs), runs that step
once more with hooks on that module only, and keeps what it received: its positional and keyword
inputs, its parameters and buffers as they were at that moment, and for a backward failure the
gradient flowing into it. From those it *records* a new bundle, with the recorder itself, whose
"model" is that one module (rebuilt from its class: the project's source from the code snapshot,
or a torch class) and whose one step runs it (see :mod:`reprokit.extract_repro`). So the extract
is a bundle like any other: ``replay``, ``inspect``, ``verify`` and ``pack`` take it, and its
packed ``repro.py`` runs with only torch, numpy and safetensors. ``run.json``'s ``extract`` says
where it came from.

When the first non-finite value comes from one aten op made from finite inputs, its inputs are
saved too (``extract/op.json``, ``extract/op.safetensors``) with ``extract/op_repro.py``, a script
that runs just that op. When no module is to blame (the step function's own loss expression made
the NaN, or the batch already held it), nothing module-level can be cut out: ``extract`` says so,
and saves that op's inputs and script alone, when the op is known.
"""

from __future__ import annotations

import copy
import importlib
import json
import math
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save
from torch.utils._pytree import tree_map

from reprokit import pytree
from reprokit.bundle import MANIFEST, RUN, Bundle, BundleWriter, claimed_output, dumps, open_bundle, sha256_file
from reprokit.errors import BundleError, DidNotReproduce, ReprokitError
from reprokit.extract_op import op_overload, refusal
from reprokit.extract_repro import TORCH_MODULES
from reprokit.origin import OriginWatcher, stamped_module, watch_step
from reprokit.replayer import Session
from reprokit.shrink.batch import batch_size
from reprokit.signature import Failure, FailureKind

MAX_MODULE_BYTES = 10_000_000
"""Above this many bytes of weights, a module is narrowed to its one op where that op shows the failure alone."""
EXTRACT_MODULE = "rk_extract"
"""Name of the generated step module in an extract's code snapshot."""
OP_FILES = ("extract/op.json", "extract/op.safetensors", "extract/op_repro.py")
_PLAIN = (bool, int, float, str, type(None))
_NO_CULPRIT = (FailureKind.LOSS_SPIKE,)
"""Failure kinds without a non-finite value or an exception, so without a module that made one. (A predicate may
fire on a non-finite value: its bundle goes through the search, which says when it finds none.)"""


class NothingToExtract(ReprokitError):
    """No module is to blame for the failure, so there is no module to cut out."""

    exit_code = 1

    def __init__(self, message: str, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.details = details or {}
        """Fields the CLI adds to its ``--json`` error object (``already_out_of_range``: what bisect layers found)."""


@dataclass
class ExtractResult:
    """What ``extract`` wrote (or, for ``module is None``, why it could not cut out a module)."""

    output: Path
    source: Path
    module: str | None
    cls: str | None
    phase: str | None
    failure: str | None
    op: str | None
    notes: list[str] = field(default_factory=list)
    bytes: int = 0
    op_raised: bool = False
    """True: ``op`` raised the failure's exception (else it made the first non-finite value)."""
    level: str = "module"
    """``module``: the extract runs the module; ``op``: it runs only ``op`` (the module was too large)."""

    def to_json(self) -> dict[str, Any]:
        return {"output": str(self.output), "source": str(self.source), "module": self.module, "class": self.cls,
                "phase": self.phase, "failure": self.failure, "op": self.op, "op_raised": self.op_raised,
                "level": self.level,
                "notes": self.notes, "bytes": self.bytes}


# --- locating the culprit ---------------------------------------------------------------

@dataclass
class _Call:
    args: Any
    kwargs: Any
    params: dict[str, torch.Tensor]
    output_bad: bool = False
    grad_outputs: list[Any] | None = None
    grad_bad: bool = False
    grad_outputs_bad: bool = False
    in_graph: bool = False
    """Its output is part of the autograd graph (a call under ``no_grad``, say a target network's, is not)."""


class _Capture:
    """Hooks on one module: what each call received, and which call first went bad."""

    def __init__(self, mod: torch.nn.Module, phase: str):
        self.mod, self.backward = mod, 0
        self.calls: list[_Call] = []
        self._current = -1
        self.first_bad: int | None = None
        """The call whose backward went non-finite first, from finite incoming gradients (backward runs the calls
        of a module used twice in reverse: the first bad one in time is not the first in call order)."""
        self.handles = [mod.register_forward_pre_hook(self._pre, with_kwargs=True),
                        mod.register_forward_hook(self._post)]
        if phase == "backward":
            self.handles += [mod.register_full_backward_pre_hook(self._back_pre),
                             mod.register_full_backward_hook(self._back)]

    @staticmethod
    def _copy(obj: Any) -> Any:
        return pytree.map_tensors(obj, lambda t: t.detach().to("cpu", copy=True))

    def _pre(self, mod: torch.nn.Module, args: Any, kwargs: Any) -> None:
        params = {k: v.detach().to("cpu", copy=True) for k, v in mod.state_dict(keep_vars=True).items()
                  if isinstance(v, torch.Tensor)}
        self.calls.append(_Call(self._copy(list(args)), self._copy(dict(kwargs)), params))

    def _post(self, mod: torch.nn.Module, args: Any, output: Any) -> None:
        call = self.calls[-1]
        leaves = _float_leaves(output)
        call.output_bad = any(not bool(torch.isfinite(t).all()) for t in leaves)
        call.in_graph = any(t.requires_grad for t in leaves)

    def _back_pre(self, mod: torch.nn.Module, grad_output: Any) -> None:
        self.backward += 1
        # Backward visits the calls that are in the graph, in reverse (a no_grad call gets no backward).
        graph = [i for i, c in enumerate(self.calls) if c.in_graph]
        index = graph[-self.backward] if self.backward <= len(graph) else -1
        if 0 <= index < len(self.calls):
            call = self.calls[index]
            call.grad_outputs = [None if g is None else g.detach().to("cpu", copy=True) for g in grad_output]
            call.grad_outputs_bad = any(not bool(torch.isfinite(t).all()) for t in _float_leaves(call.grad_outputs))
        self._current = index

    def _back(self, mod: torch.nn.Module, grad_input: Any, grad_output: Any) -> None:
        index = self._current
        params_bad = any(p.grad is not None and not bool(torch.isfinite(p.grad).all()) for p in mod.parameters())
        if 0 <= index < len(self.calls):
            call = self.calls[index]
            call.grad_bad = params_bad or any(not bool(torch.isfinite(t).all()) for t in _float_leaves(grad_input))
            if call.grad_bad and not call.grad_outputs_bad and self.first_bad is None:
                self.first_bad = index

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _float_leaves(obj: Any) -> list[torch.Tensor]:
    return [t for _, t in pytree.leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()]


class _OpCapture(OriginWatcher):
    """The origin watcher; ``op`` encodes the inputs of the op that *made* the first non-finite value.

    (No frame of this module may run inside the watcher: origin sites skip reprokit's own frames.)
    """

    @property
    def op(self) -> dict[str, Any] | None:
        if self.created_call is None:
            return None
        func, args, kwargs = self.created_call
        return None if refusal(func) else _encode_op(func, args, kwargs)


@dataclass
class _Raised:
    """An aten op that raised while the step ran: its inputs (copied), the error, and where it ran."""

    func: Any
    args: Any
    kwargs: Any
    error: BaseException
    phase: str
    module: str | None
    node: str | None


class _RaiseCapture(OriginWatcher):
    """Records every aten op that raises while the step runs (the watcher's own checks stay off).

    Run through :func:`watch_step`, so that autograd nodes carry the module whose forward made them:
    an op raising in backward is placed by its node.
    """

    def __init__(self) -> None:
        super().__init__(active=False)
        self.raised: list[_Raised] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception as e:
            current = getattr(torch._C, "_current_autograd_node", None)  # the backward node running now, if any
            node = current() if current is not None else None
            module = stamped_module(node) if node is not None else \
                (self.stack[-1] if self.stack else None)
            saved_args, saved_kwargs = tree_map(
                lambda v: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v, (args, kwargs))
            self.raised.append(_Raised(func, saved_args, saved_kwargs, e, "backward" if node is not None else "forward",
                                       module, node.name() if node is not None else None))
            raise

    def matching(self, failure: Failure | None) -> _Raised | None:
        """The last op whose error is the step's failure (same type, same first line), if any op raised it."""
        if failure is None or failure.kind != FailureKind.EXCEPTION:
            return None
        for r in reversed(self.raised):
            msg = str(r.error).splitlines()[0][:500] if str(r.error) else ""
            if type(r.error).__qualname__ == failure.exc_type and msg == failure.message:
                return r
        return None


def _encode_op(func: Any, args: Any, kwargs: Any) -> dict[str, Any] | None:
    """``{"op", "args", "kwargs", "tensors"}`` for a one-op repro; None for arguments JSON cannot hold."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = v.detach().to("cpu", copy=True).contiguous()
            return {"tensor": key}
        if isinstance(v, float) and not math.isfinite(v):
            return {"float": repr(v)}
        if isinstance(v, _PLAIN):
            return v
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        if isinstance(v, torch.dtype):
            return {"dtype": str(v).removeprefix("torch.")}
        if isinstance(v, torch.device):
            return {"device": "cpu"}
        raise TypeError(type(v).__name__)

    try:
        return {"op": str(func), "args": [enc(a) for a in args], "kwargs": {k: enc(v) for k, v in kwargs.items()},
                "tensors": tensors}
    except TypeError:
        return None


# --- the module as data -------------------------------------------------------------------

def _module_spec(mod: torch.nn.Module, skipped: list[str], path: str = "") -> dict[str, Any]:
    """How :func:`reprokit.extract_repro._make` rebuilds ``mod``: class, plain attributes, tensor shapes."""
    cls = type(mod)
    module = cls.__module__
    f = getattr(sys.modules.get(module), "__file__", None)
    if f and (module == "__main__" or module.startswith("_reprokit_script_")):
        module = Path(f).stem  # a class of the training script itself (as run, or as replay loads it)
    attrs: dict[str, Any] = {}
    for k, v in vars(mod).items():
        if k.startswith("_"):
            continue
        if _plain(v):
            attrs[k] = v
        else:
            skipped.append(f"{path}{k} ({type(v).__name__})")
    return {
        "class": {"module": module, "qualname": cls.__qualname__},
        "attrs": attrs,
        "params": {k: None if p is None else {"dtype": str(p.dtype).removeprefix("torch."), "shape": list(p.shape),
                                              "requires_grad": bool(p.requires_grad)}
                   for k, p in mod._parameters.items()},
        "buffers": {k: None if b is None else {"dtype": str(b.dtype).removeprefix("torch."), "shape": list(b.shape)}
                    for k, b in mod._buffers.items()},
        "children": {k: None if c is None else _module_spec(c, skipped, f"{path}{k}.")
                     for k, c in mod._modules.items()},
    }


def _foreign(spec: dict[str, Any]) -> str | None:
    """The first class of ``spec``'s tree that is neither the project's (a file outside installed packages) nor one
    of torch's layers: ``rk_extract`` refuses to build those (a bundle never chooses what code runs)."""
    ref = spec["class"]
    f = getattr(sys.modules.get(ref["module"]), "__file__", None)
    if not ref["module"].startswith(TORCH_MODULES) and f is not None and _library(f):
        return f"{ref['module']}.{ref['qualname']}"
    return next((found for c in spec["children"].values() if c is not None and (found := _foreign(c))), None)


def _plain(v: Any) -> bool:
    if isinstance(v, _PLAIN):
        return True
    if isinstance(v, dict):  # a config dict kept on the module; JSON keeps str keys only
        return type(v) is dict and all(isinstance(k, str) and _plain(x) for k, x in v.items())
    return isinstance(v, (list, tuple)) and all(_plain(x) for x in v)


# --- the extract ----------------------------------------------------------------------------

def extract(bundle: Bundle, output: str | Path, *, device: str | None = None, code: Any = None,
            source: str | Path | None = None, max_module_bytes: int | None = MAX_MODULE_BYTES) -> ExtractResult:
    """Cut the module that failed out of ``bundle`` into a new, small bundle at ``output``.

    ``source`` names the bundle in the extract's ``run.json`` (default: its folder; the CLI passes
    the archive's path for a ``.tar.gz``, whose folder is a temporary one). A module whose parameters
    and buffers hold more than ``max_module_bytes`` (None: no limit) is narrowed to the one aten op
    that made the value or raised, where that op alone shows the failure (``level`` is then ``op``).

    Raises:
        DidNotReproduce: the bundle does not fail when replayed, or the module alone does not.
        NothingToExtract: no module is to blame (the failure's origin is the step function's own code,
            or the batch); ``output`` then holds that op's repro when the op is known. Also when the module's
            inputs (or weights) were already out of range, grown over the steps before (an LR too high):
            ``details["already_out_of_range"]`` says where they grew, and nothing is written.
        ReprokitError: ``output`` exists and is not empty.

    Example:
        >>> extract(open_bundle("repros/bundle-..."), "small").module              # doctest: +SKIP
        'blocks.3.attn'
    """
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ReprokitError(f"{output} exists and is not an empty folder; name a new folder for the extract")
    with claimed_output(output):
        return _extract(bundle, output, device=device, code=code, source=source, max_module_bytes=max_module_bytes)


def _extract(bundle: Bundle, output: Path, *, device: str | None, code: Any, source: str | Path | None,
             max_module_bytes: int | None) -> ExtractResult:
    if bundle.failure.kind in _NO_CULPRIT:
        raise NothingToExtract(f"{bundle.path} failed with a {bundle.failure.describe()}: no value went non-finite "
                               "and nothing raised, so there is no module or op that made it to cut out; `reprokit "
                               "shrink` makes the bundle smaller and `reprokit bisect steps` finds the step it starts "
                               "at instead")
    from reprokit.bisect.layers import bisect_layers

    located = bisect_layers(bundle, device=device, code=code)
    if located.get("failure") is None:
        raise DidNotReproduce(f"{bundle.path} did not fail when replayed, so there is nothing to cut out; "
                              "check `reprokit replay` first")
    grown = located.get("already_out_of_range")
    if grown:
        raise NothingToExtract(f"{bundle.path}: no module is to blame: {grown['summary']}. A repro of that module "
                               "would only show an op given values that were already out of range; fix where they "
                               "grew (the LR, its warmup, clipping), then record again", {"already_out_of_range": grown})
    target = _target(located)
    with Session(bundle, device=device, code=code) as s:
        inputs = s.inputs()
        before = s.advance(inputs[:-1]) if len(inputs) > 1 else s.snapshot
        if before is None:
            raise DidNotReproduce(f"{bundle.path}: the window failed before its last step; replay or shrink it "
                                  "first (`reprokit replay`), then extract")
        watcher = _OpCapture(batch_size(inputs[-1].batch))
        raised, notes = None, []
        if bundle.failure.kind == FailureKind.EXCEPTION:
            raiser = _RaiseCapture()
            raised = raiser.matching(watch_step(s, inputs[-1], before, None, raiser)[0].failure)
            notes += _raise_notes(raised, bundle.failure)
            if raised is not None and raised.module is not None:
                target = raised.module, raised.phase  # the module that ran the op, placed by its autograd node
        elif target is None or located["raised_in"] is None:
            watch_step(s, inputs[-1], before, watcher.rows, watcher)
        if target is None:
            return _nothing(bundle, output, located, watcher, raised)
        name, phase = target
        assert s.state is not None
        mod = s.state.model if name == "<model>" else s.state.model.get_submodule(name)
        cap = _Capture(mod, phase)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                warnings.filterwarnings("ignore", message="For backward hooks to be called")  # see bisect.layers
                s.run(inputs[-1:], before)
        finally:
            cap.close()
        call = _pick(cap, phase, bundle.failure.kind == FailureKind.EXCEPTION)
        origin = watcher.origin
        made_in_phase = origin is not None and origin.created and origin.phase == phase and \
            _inside(origin.module, name)
        bad = _already_bad(call, phase, made_in_phase, mod) if bundle.failure.kind != FailureKind.EXCEPTION else None
        if bad is not None:
            raise DidNotReproduce(f"module {name} ({type(mod).__qualname__}) received the non-finite value in {bad} "
                                  f"({phase}) when the failing step ran again, so it did not make it there: no "
                                  "module-level repro; see `reprokit bisect layers` for where it first appears")
        skipped: list[str] = []
        spec = _module_spec(mod, skipped)
        cls_file = getattr(sys.modules.get(type(mod).__module__), "__file__", None)
        if raised is not None:
            op = _encode_op(raised.func, raised.args, raised.kwargs)
            if op is None:
                notes.append(f"{raised.func} raised it, but its arguments cannot be saved: no one-op repro")
            else:
                op["raises"] = {"type": type(raised.error).__qualname__, "message": bundle.failure.message}
        else:
            made_here = watcher.origin is not None and watcher.origin.created and _inside(watcher.origin.module, name)
            op = watcher.op if made_here else None
            if made_here and op is None:
                notes.append(_no_op_note(watcher))
        op = _checked(op, notes)
        code_dir = s.code_dir
    source = Path(source) if source is not None else bundle.path
    foreign = _foreign(spec)
    if foreign is not None:
        why = (f"module {name} ({type(mod).__qualname__}) is built from {foreign}, a class of an installed package: "
               "an extract runs only the project's classes (from its code snapshot) and torch's layers "
               f"({TORCH_MODULES[:-1]}), never a class its run.json names elsewhere")
        if op is None:
            raise DidNotReproduce(f"{why}, so it cannot be cut out on its own; use the whole bundle, or `reprokit "
                                  "shrink` it instead" + _said(notes))
        notes.append(f"{why}: the extract is the one op that {'raised' if 'raises' in op else 'made'} it, "
                     f"{op['op']}, on its saved inputs")
        return _write(bundle, output, name, type(mod).__qualname__, phase, _op_spec(op), _op_call(op), op, None,
                      None, notes, source, level="op")
    weights = sum(t.numel() * t.element_size() for t in call.params.values())
    if max_module_bytes is not None and weights > max_module_bytes:
        if op is not None:
            notes.append(f"module {name} ({type(mod).__qualname__}) holds {weights / 1e6:.1f} MB of weights, over "
                         f"{max_module_bytes / 1e6:g} MB: the extract is the one op that "
                         f"{'raised' if 'raises' in op else 'made'} it, {op['op']}, on its saved inputs")
            return _write(bundle, output, name, type(mod).__qualname__, phase, _op_spec(op), _op_call(op), op, None,
                          None, notes, source, level="op")
        notes.append(f"module {name} ({type(mod).__qualname__}) holds {weights / 1e6:.1f} MB of weights, over "
                     f"{max_module_bytes / 1e6:g} MB, and no one op shows the failure alone: the extract carries them")
    notes += [f"attributes not carried (not plain data): {', '.join(skipped)}"] if skipped else []
    return _write(bundle, output, name, type(mod).__qualname__, phase, spec, call, op, code_dir, cls_file, notes,
                  source)


def _no_op_note(watcher: _OpCapture) -> str:
    """Why the op that made the first non-finite value has no one-op repro."""
    func = watcher.created_call[0] if watcher.created_call is not None else None
    if func is not None and func._schema.is_mutable:
        return (f"{func} made it, writing in place: its input's value before the write is gone, so there is no "
                "one-op repro; the module-level repro shows it")
    if func is not None and (why := refusal(func)) is not None:
        return f"{func} made it, but it is not a pure tensor op ({why}): no one-op repro"
    return f"{func or 'the op that made it'} takes arguments that cannot be saved: no one-op repro"


def _op_spec(op: dict[str, Any]) -> dict[str, Any]:
    """The module spec of :class:`reprokit.extract_repro.AtenOp` running ``op`` (its arguments as JSON)."""
    call = json.dumps({"args": op["args"], "kwargs": op["kwargs"]}, sort_keys=True)
    return {"class": {"module": EXTRACT_MODULE, "qualname": "AtenOp"}, "attrs": {"op": op["op"], "call": call},
            "params": {}, "buffers": {}, "children": {}}


def _op_call(op: dict[str, Any]) -> _Call:
    """The op's tensors, in the order ``AtenOp.forward`` takes them (``t0``, ``t1``, ...)."""
    return _Call(args=[op["tensors"][f"t{i}"] for i in range(len(op["tensors"]))], kwargs={}, params={})


def _raise_notes(raised: _Raised | None, failure: Failure) -> list[str]:
    if raised is not None:
        return []
    where = f" ({failure.frame})" if failure.frame else ""
    return [f"no aten op raised {failure.exc_type}: Python code raised it{where}, so there is no one-op repro; the "
            "module-level repro shows it"]


def _target(located: dict[str, Any]) -> tuple[str, str] | None:
    if located.get("raised_in"):
        return located["raised_in"]["module"], located["raised_in"].get("phase", "forward")
    first = located.get("first_nonfinite")
    origin = located.get("origin") or {}
    if origin.get("created") and origin.get("module") and origin.get("phase") in ("forward", "backward"):
        # The innermost module running the op that made the value. The module hooks may first see it
        # at a child that only carried it (post hooks fire innermost first: attention's NaN from a
        # functional softmax shows first at its output projection, whose inputs were already NaN).
        return origin["module"], origin["phase"]
    if first is None or first.get("inputs_already_nonfinite") or (origin and origin.get("module") is None):
        return None
    return first["module"], first["phase"]


def _inside(module: str | None, name: str) -> bool:
    return module is not None and (name == "<model>" or module == name or module.startswith(name + "."))


def _pick(cap: _Capture, phase: str, exception: bool) -> _Call:
    calls = cap.calls
    if not calls:
        raise DidNotReproduce("the module was not called when the failing step ran again; it may be skipped "
                              "depending on the data. Replay the bundle to check it still fails the same way")
    if exception:
        # An exception: in forward, the last call raised; in backward, the call whose backward was running.
        return calls[cap._current] if phase == "backward" and 0 <= cap._current < len(calls) else calls[-1]
    if phase == "backward":
        if cap.first_bad is not None:
            return calls[cap.first_bad]
        return next((c for c in reversed(calls) if c.grad_bad), calls[-1])  # the first visited by backward
    return next((c for c in calls if c.output_bad), calls[-1])


def _already_bad(call: _Call, phase: str, made_here: bool, mod: torch.nn.Module) -> str | None:
    """What of the picked call's inputs already holds the non-finite value (then it did not make the value).

    ``made_here``: the origin watcher saw the value created (NaN from NaN-free inputs, inf from inf-free ones) by an
    op this module ran, in this phase. In backward, the value is a gradient: what flows into it is the gradient of
    its output. Its forward inputs are what its backward computes with, like its weights; one holding a non-finite
    value counts only when its forward passed it on (its output was non-finite too), or when the origin check did not
    find the value made in this module's backward. In forward, a non-finite input counts unless the module, made the
    value here, makes a non-finite value again with those inputs set to 1 (:func:`_makes_it_alone`): an attention
    mask's ``-inf``, which the module turns into finite values (``exp(-inf) = 0``) in every step, healthy or not, is
    then no reason to refuse it, while a batch's inf that the module only sums into a NaN is.
    """
    if phase == "backward" and call.grad_outputs_bad:
        return "the gradient flowing into it"
    if phase == "backward" and made_here and not call.output_bad:
        return None
    if not any(not bool(torch.isfinite(t).all()) for t in _float_leaves((call.args, call.kwargs))):
        return None
    if phase == "forward" and made_here and _makes_it_alone(call, mod):
        return None
    return "its inputs"


def _makes_it_alone(call: _Call, mod: torch.nn.Module) -> bool:
    """Whether a copy of ``mod``, with its weights as they were at the call, still returns a non-finite value from the
    call's inputs with their non-finite entries set to 1 (a counterfactual run, on a copy, so nothing of the replayed
    state changes; 1 rather than 0, so that a division by a sum makes no 0/0 of its own). It runs on the host, in the
    recorded dtypes but without the step's autocast: a value that overflows only under autocast is not made again,
    and the module is then refused (the safe answer: no repro rather than a wrong one)."""
    def zeroed(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return torch.nan_to_num(v.detach(), nan=1.0, posinf=1.0, neginf=1.0)  # 1, not 0: no 0/0 of our own
        return v.detach() if isinstance(v, torch.Tensor) else v

    try:
        twin = copy.deepcopy(mod).to("cpu")  # the call's inputs and weights were copied to the host
        twin.load_state_dict(call.params, strict=False)  # as they were at the call, not after the step's update
        for sub in twin.modules():  # hooks copied with it (reprokit's own watchers) must not see this run
            sub._forward_hooks.clear()
            sub._forward_pre_hooks.clear()
            sub._backward_hooks.clear()
            sub._backward_pre_hooks.clear()
        with torch.no_grad(), torch.random.fork_rng(devices=[]):  # a dropout in it draws from a forked generator
            out = twin(*tree_map(zeroed, call.args), **tree_map(zeroed, call.kwargs))
    except Exception:  # a module that cannot run twice or be copied: keep the refusal (the safe answer)
        return False
    return any(not bool(torch.isfinite(t).all()) for t in _float_leaves(out))


def _nothing(bundle: Bundle, output: Path, located: dict[str, Any], watcher: _OpCapture,
             raised: _Raised | None) -> ExtractResult:
    if bundle.failure.kind == FailureKind.EXCEPTION:
        return _nothing_raised(bundle, output, raised)
    origin = watcher.origin
    where = origin.describe() if origin is not None else "unknown (no op made a non-finite value)"
    first = located.get("first_nonfinite") or {}
    if origin is not None and not origin.created:
        why = f"the batch or the state already held it: {where}; see `reprokit inspect {bundle.path}`"
    elif origin is not None and origin.module is None:
        why = f"the step function made it outside every module: {where}"
    elif first.get("module") is None:
        why = f"no module's output or gradient went non-finite when the step ran again: {where}"
    else:
        why = f"first seen in {first.get('module')} with inputs already non-finite: {where}"
    msg = f"no module to blame, so no module-level extract: {why}."
    notes: list[str] = []
    op = _checked(watcher.op, notes)
    if op is not None:
        _save_op_alone(output, op)
        msg += (f" The inputs of {op['op']} are saved in {output}: `python {output / 'op_repro.py'}` "
                "runs that op alone.")
    raise NothingToExtract(" ".join([msg, *notes]))


def _nothing_raised(bundle: Bundle, output: Path, raised: _Raised | None) -> ExtractResult:
    f = bundle.failure
    where = f" ({f.frame})" if f.frame else ""
    msg = f"no module to blame, so no module-level extract: {f.exc_type} was raised outside every module{where}."
    op = _encode_op(raised.func, raised.args, raised.kwargs) if raised is not None else None
    notes: list[str] = []
    if op is not None and raised is not None:
        op["raises"] = {"type": type(raised.error).__qualname__, "message": f.message}
        op = _checked(op, notes)
    if op is not None:
        _save_op_alone(output, op)
        msg += (f" {op['op']} raised it; its inputs are saved in {output}: `python {output / 'op_repro.py'}` runs "
                "that op alone.")
    elif raised is None:
        msg += " No aten op raised it (Python code did), so there is no one-op repro either."
    elif not notes:
        msg += f" {raised.func} raised it, but its arguments cannot be saved: no one-op repro."
    raise NothingToExtract(" ".join([msg, *notes]))


def _checked(op: dict[str, Any] | None, notes: list[str]) -> dict[str, Any] | None:
    """``op`` when running it alone on the CPU, on its saved inputs, shows the bug again; else None, said in
    ``notes`` (a one-op repro that does not reproduce would be a wrong repro)."""
    if op is None:
        return None
    from reprokit.extract_op import run as run_op

    try:
        op_overload(op["op"])  # what one-op repros run (a pure tensor op), checked as they check it
    except ValueError as e:
        notes.append(f"{e}: no one-op repro written")
        return None

    try:
        ok = run_op(op, {k: v.clone() for k, v in op["tensors"].items()}, "cpu", say=lambda _: None)
    except Exception:  # noqa: BLE001 - an op that fails otherwise alone does not reproduce it either
        ok = False
    if not ok:
        notes.append(f"{op['op']} alone, on the inputs it received, run on the CPU, does not show the failure again "
                     "(it may need the original device or state): no one-op repro written")
    return op if ok else None


def _op_files(op: dict[str, Any]) -> dict[str, bytes]:
    doc = {k: op[k] for k in ("op", "args", "kwargs", "raises") if k in op}
    return {OP_FILES[0]: dumps(doc), OP_FILES[1]: st_save(op["tensors"] or {}),
            OP_FILES[2]: (Path(__file__).parent / "extract_op.py").read_bytes()}


def _save_op_alone(output: Path, op: dict[str, Any]) -> None:
    """The one-op repro's files, loose in ``output`` (no module to extract, so no bundle around them)."""
    output.mkdir(parents=True, exist_ok=True)
    for rel, data in _op_files(op).items():
        (output / Path(rel).name).write_bytes(data)


def _write(bundle: Bundle, output: Path, name: str, cls: str, phase: str, spec: dict[str, Any], call: _Call,
           op: dict[str, Any] | None, code_dir: Path | None, cls_file: str | None, notes: list[str],
           source: Path, level: str = "module") -> ExtractResult:
    """Record the module's (or, ``level="op"``, the op's) one step with the recorder, then add ``extract`` to its
    run.json (and the op files)."""
    import reprokit
    from reprokit.code import imported

    run_phase = phase if level == "module" else "forward"  # an op runs forward, whichever pass it came from
    batch: dict[str, Any] = {"phase": run_phase, "args": call.args, "kwargs": call.kwargs}
    if run_phase == "backward":
        batch["grad_outputs"] = call.grad_outputs or []
    try:
        pytree.encode(batch, "batch")  # what the recorder below must write: say why here, not "does not fail"
    except ReprokitError as e:
        raise DidNotReproduce(f"module {name} ({cls}) takes an input that a bundle cannot hold ({e}), so it cannot "
                              "be cut out on its own; use the whole bundle, or `reprokit shrink` it instead") from e
    config = {"module": spec}
    with tempfile.TemporaryDirectory(prefix="reprokit-extract-") as tmp:
        work = Path(tmp) / "code"
        if code_dir is not None and code_dir.is_dir():
            shutil.copytree(code_dir, work, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            work.mkdir()
        if cls_file and not (work / Path(cls_file).name).exists() and not _library(cls_file):
            shutil.copy2(cls_file, work / Path(cls_file).name)
        (work / f"{EXTRACT_MODULE}.py").write_bytes((Path(__file__).parent / "extract_repro.py").read_bytes())
        objects = _project_classes(spec)
        with imported(work, objects), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the recorder's notes about this throwaway run are not the user's
            mod = importlib.import_module(EXTRACT_MODULE)
            state = mod.build(config)
            state.model.load_state_dict(call.params, strict=False)
            rec = reprokit.Recorder(state, mod.train_step, build=mod.build, config=config,
                                    out_dir=Path(tmp) / "out", snapshot_every=1, check_grads=False,
                                    max_lag=0)  # one step, judged at its own end
            rec._refs["objects"] = objects  # the snapshot's classes the config names: vetted before replay imports
            try:
                rec.step(batch)
                recorded = None
            except Exception as e:  # noqa: BLE001 - the module's own failure is what we want
                recorded = e
            finally:
                rec.close()
        what = f"module {name} ({cls})" if level == "module" else f"op {spec['attrs']['op']}"
        if recorded is None or not rec.bundles:
            raise DidNotReproduce(f"{what} alone, on the inputs it received, does not fail the same "
                                  "way (its failure may need state it does not hold); use the whole bundle, or "
                                  "`reprokit shrink` it instead")
        if bundle.failure.kind == FailureKind.EXCEPTION and type(recorded).__qualname__ != bundle.failure.exc_type:
            raise DidNotReproduce(f"{what} alone raises {type(recorded).__qualname__}, not the "
                                  f"bundle's {bundle.failure.exc_type}: it does not fail the same way alone; use the "
                                  "whole bundle, or `reprokit shrink` it instead" + _said(notes))
        if bundle.failure.kind != FailureKind.EXCEPTION and not _nonfinite_check(recorded):
            # The bundle's failure is a non-finite value: only rk_extract's own check finding one is that failure
            # (the module raising, say for an attribute the extract could not carry, is another one).
            raise DidNotReproduce(f"{what} alone raises {type(recorded).__qualname__}: "
                                  f"{str(recorded).splitlines()[0][:300] if str(recorded) else ''}, where the bundle "
                                  f"failed with {bundle.failure.describe()}: it does not fail the same way alone; use "
                                  "the whole bundle, or `reprokit shrink` it instead" + _said(notes))
        failure = f"{type(recorded).__name__}: {str(recorded).splitlines()[0][:300]}"
        info = {"source_bundle": str(source), "source_manifest_sha256": sha256_file(bundle.path / MANIFEST),
                "source_step": bundle.failure.step, "source_failure": bundle.failure.describe(), "module": name,
                "class": f"{spec['class']['module']}.{spec['class']['qualname']}" if level == "module" else cls,
                "phase": phase, "op": op["op"] if op else None, "level": level}
        path = _rewrite(rec.bundles[-1], output, info, op)
    size = sum(int(m["size"]) for m in json.loads((path / MANIFEST).read_text())["files"].values())
    return ExtractResult(output=path, source=source, module=name, cls=cls, phase=phase, failure=failure,
                         op=op["op"] if op else None, notes=notes, bytes=size, op_raised=bool(op and "raises" in op),
                         level=level)


def _nonfinite_check(exc: BaseException) -> bool:
    """True when ``exc`` is the extract step's own finding of a non-finite value (rk_extract's ``_check``)."""
    from reprokit.signature import user_frame

    return type(exc) is FloatingPointError and user_frame(exc.__traceback__) == f"{EXTRACT_MODULE}.py:_check"


def _said(notes: list[str]) -> str:
    return "".join(f"; note: {n}" for n in notes)


def _library(path: str) -> bool:
    return "site-packages" in Path(path).parts or "dist-packages" in Path(path).parts or \
        Path(path).resolve().is_relative_to(Path(torch.__file__).resolve().parent)


def _rewrite(recorded: Path, output: Path, info: dict[str, Any], op: dict[str, Any] | None) -> Path:
    """Copy the recorded bundle to ``output`` with ``run.json``'s ``extract`` set (and the op files added)."""
    src = open_bundle(recorded)
    w = BundleWriter(output.parent, output.name, exact=True)  # an empty folder there (checked above) is replaced
    with w:
        for rel in sorted(src.manifest["files"]):
            if rel == RUN:
                w.write_json(rel, {**src.run, "extract": info})
            else:
                w.copy_file(rel, src.path / rel)
        for rel, data in (_op_files(op).items() if op else ()):
            w.write_bytes(rel, data)
        path = w.commit()
    if path != output:
        raise BundleError(f"{output} appeared while the extract was written; it is at {path} instead")
    return path


def format_extract(d: dict[str, Any]) -> str:
    head = f"extracted module {d['module']} ({d['class']})" if d.get("level", "module") == "module" else \
        f"extracted op {d['op']} alone (of module {d['module']}, {d['class']})"
    lines = [f"{head}, {d['phase']}, from {d['source']}",
             f"  it fails alone: {d['failure']}"]
    if d.get("op"):
        what = "raised by one op" if d.get("op_raised") else "first bad value made by one op"
        lines.append(f"  {what}, {d['op']}: python {d['output']}/extract/op_repro.py")
    lines += [f"  note: {n}" for n in d.get("notes") or []]
    lines.append(f"wrote {d['output']} ({d['bytes'] / 1e3:.1f} kB); `reprokit replay {d['output']}` exits 1 while "
                 "it fails, `reprokit pack` ships it")
    return "\n".join(lines)


def _project_classes(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The class refs of ``spec`` and its children that are the project's (not torch's layers), once each: what
    the extract bundle lists under ``refs.objects``, the only classes its replay may import."""
    found: list[dict[str, Any]] = []
    todo = [spec]
    while todo:
        s = todo.pop()
        ref = s["class"]
        if not str(ref.get("module", "")).startswith(TORCH_MODULES) and ref not in found:
            found.append(ref)
        todo.extend(s.get("children", {}).values())
    return found
