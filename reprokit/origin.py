"""Where a non-finite failure starts: the first op that made a NaN or inf, where it ran, and in which rows.

A non-finite loss says little on its own: a 0/0 in the loss expression, an
overflow in an attention layer and a NaN token embedding all end as ``loss =
nan``. The *origin* tells them apart. The failing step is run once more with

- a ``TorchDispatchMode`` that checks every aten op's floating outputs, and
- a ``TorchFunctionMode`` that stamps each autograd node with the module and
  the user-code line whose forward op created it (so that an op in backward
  can be placed too, also when the autograd engine runs on a device thread).

The origin is the first op that *creates* a non-finite value: NaN out of
NaN-free inputs, or inf out of inf-free inputs (scalar arguments included).
This skips the ``-inf`` an attention mask writes on purpose (the ``-inf`` came
in as an argument) but catches the NaN a fully masked softmax row makes from
it. When nothing is created (the NaN was already in the batch or the state),
the first op whose output holds a NaN (else an inf) is the origin instead.

An origin records its place (forward / backward / optimizer, the aten op, the
innermost model module or ``None`` for "in the step function, outside every
module", the ``file:line`` in user code, and in backward the autograd node)
and the batch rows whose values were non-finite there (when the op's output
is laid out ``[rows, ...]``).

Ops run by reprokit itself (the gradient-norm check in the optimizer pre-hook)
are not watched. Watching costs one ``isfinite`` reduction (a device sync on a
GPU) per op, so it runs only in origin checks, never while recording.
"""

from __future__ import annotations

import math
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from reprokit.replayer import RunOutcome, Session, StepInput
from reprokit.signature import NONFINITE

_KEY = "reprokit_origin"
"""Key of the ``(module, site)`` stamp in an autograd node's ``metadata``."""

_UNINITIALISED = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_",
                            "set_"})
"""Ops whose output is whatever the allocator held: a NaN there is no origin."""

_OURS = os.path.dirname(os.path.realpath(__file__)) + os.sep
_THIS = os.path.realpath(__file__)
_LIBRARY = tuple(os.path.realpath(p) + os.sep for p in {
    sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
    os.path.dirname(torch.__file__)})
_REPROKIT = object()
_kinds: dict[str, str] = {}


@dataclass(frozen=True)
class Origin:
    """The first non-finite value of a step."""

    phase: str
    """``forward`` (the step function and the model's forward), ``backward`` or ``optimizer``."""
    op: str
    """The aten op overload, e.g. ``aten.div.Tensor``."""
    value: str
    """``nan`` or ``inf``."""
    created: bool
    """True: the op made it from finite inputs. False: it only carried one in (from the batch or the state)."""
    module: str | None
    """The innermost module of the model running the op (in backward: running its forward); None: outside every
    module, in the step function's own code."""
    site: str | None
    """``file:line`` of the innermost user-code frame (in backward: where the node's forward op was called)."""
    node: str | None = None
    """The autograd node, in backward (e.g. ``SqrtBackward0``)."""
    rows: tuple[int, ...] | None = None
    """Rows of the batch (as run) whose values were non-finite in the op's output; None when the output is
    not laid out ``[rows, ...]``."""

    def place(self) -> tuple[Any, ...]:
        """Everything but the rows: two origins at the same place are the same bug."""
        return (self.phase, self.op, self.value, self.created, self.module, self.site, self.node)

    def describe(self) -> str:
        where = f"module {self.module}" if self.module else "the step function, outside every module"
        how = "made" if self.created else "first seen"
        node = f" ({self.node})" if self.node else ""
        site = f" at {self.site}" if self.site else ""
        rows = f", rows {list(self.rows)}" if self.rows is not None else ""
        return f"{self.value} {how} by {self.op}{node} in {where}{site}, {self.phase}{rows}"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["rows"] = list(self.rows) if self.rows is not None else None
        return d | {"summary": self.describe()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Origin:
        rows = d.get("rows")
        return cls(d["phase"], d["op"], d["value"], d["created"], d.get("module"), d.get("site"), d.get("node"),
                   tuple(rows) if rows is not None else None)


def _user_site() -> Any:
    """``file:line`` of the innermost frame outside python/torch/site-packages; ``_REPROKIT`` when that frame is
    reprokit's own; None when there is no such frame (an autograd engine thread)."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        kind = _kinds.get(name)
        if kind is None:
            path = os.path.realpath(name)
            kind = _kinds[name] = "lib" if name.startswith("<") or path.startswith(_LIBRARY) or path == _THIS \
                else "ours" if path.startswith(_OURS) else "user"
        if kind == "ours":
            return _REPROKIT
        if kind == "user":
            return f"{os.path.basename(name)}:{f.f_lineno}"
        f = f.f_back  # type: ignore[assignment]
    return None


def value_stats(obj: Any) -> dict[str, Any] | None:
    """Finite |min|, |max| and the count of non-finite values over the floating tensors in ``obj``."""
    ts = _floats(obj)
    if not ts:
        return None
    with torch.no_grad():
        flat = torch.cat([t.detach().float().reshape(-1) for t in ts])
        finite = flat[torch.isfinite(flat)].abs()
        return {"abs_min": float(finite.min()) if finite.numel() else None,
                "abs_max": float(finite.max()) if finite.numel() else None,
                "nonfinite": int((~torch.isfinite(flat)).sum()), "numel": int(flat.numel())}


def _floats(obj: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.layout == torch.strided and t.numel()]


def _guarded(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - an unusual tensor (subclass, meta) is simply not watched
        return None


def _has(ts: list[torch.Tensor], scalars: list[float], test: Callable[[Any], Any],
         scalar_test: Callable[[float], bool]) -> bool:
    return any(bool(test(t).any()) for t in ts) or any(scalar_test(s) for s in scalars)


@dataclass
class _Inputs:
    nan: bool
    inf: bool


def _inputs(args: Any, kwargs: Any) -> _Inputs:
    leaves = tree_leaves((args, kwargs))
    ts = _floats(leaves)
    scalars = [float(v) for v in leaves if isinstance(v, float)]
    return _Inputs(_has(ts, scalars, torch.isnan, math.isnan), _has(ts, scalars, torch.isinf, math.isinf))


class OriginWatcher(TorchDispatchMode):
    """Dispatch mode that finds the origin among the ops it sees while ``active``.

    ``rows`` is the batch size of the step (to attribute non-finite values to rows);
    ``stack`` the model modules whose forward is running; ``first_nonfinite`` the first op
    with any non-finite output (what ``bisect layers`` reports inside a module).
    """

    def __init__(self, rows: int | None = None, active: bool = True):
        super().__init__()
        self.rows = rows
        self.active = active
        self.stack: list[str] = []
        self.optimizing = False
        self.created: Origin | None = None
        self.first_nan: Origin | None = None
        self.first_any: Origin | None = None
        self.first_nonfinite: dict[str, Any] | None = None
        self.created_call: tuple[Any, Any, Any] | None = None
        """``(func, args, kwargs)`` of the op that made the origin (``reprokit extract``'s one-op repro)."""
        self.nan_counts = True
        """False when the failing value is +-inf: a NaN, which no later op turns into an inf, cannot be its origin
        (a NaN that AdamW makes of a batch's inf, after the loss was already inf, made nothing that failed)."""

    @property
    def origin(self) -> Origin | None:
        return self.created or self.first_nan or self.first_any

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        watch = self.active and self.created is None and func.overloadpacket.__name__ not in _UNINITIALISED
        before = None
        if watch and func._schema.is_mutable:
            # An op writing into its input hides what the input held: look before it runs.
            before = _guarded(lambda: _inputs(args, kwargs))
            watch = before is not None
        out = func(*args, **kwargs)
        if watch:
            # Watching must never change what the step does: a tensor it cannot check is skipped.
            bad = _guarded(lambda: [t for t in _floats(out) if not bool(torch.isfinite(t).all())])
            if bad:
                _guarded(lambda: self._seen(func, args, kwargs, bad, before or _inputs(args, kwargs)))
        return out

    def _seen(self, func: Any, args: Any, kwargs: Any, bad: list[torch.Tensor], ins: _Inputs) -> None:
        where = self._where()
        if where is None:
            return
        nan = _has(bad, [], torch.isnan, math.isnan)
        inf = _has(bad, [], torch.isinf, math.isinf)
        if not self.nan_counts:
            nan = False
            if not inf:
                return
        value = "nan" if nan and not ins.nan else "inf" if inf and not ins.inf else None
        if self.first_nonfinite is None:
            self.first_nonfinite = {"op": str(func.overloadpacket.__name__), "overload": str(func),
                                    "created": value is not None, "inputs": value_stats(list(args)),
                                    "output": value_stats(bad)}
        if value is not None:
            self.created = self._origin(func, value, True, bad, where)
            # Copied now: the optimizer (or an in-place op) may change these inputs later in the step.
            self.created_call = (func, *tree_map(lambda v: v.detach().clone() if isinstance(v, torch.Tensor) else v,
                                                 (args, kwargs)))
        elif nan and self.first_nan is None:
            self.first_nan = self._origin(func, "nan", False, bad, where)
        elif self.first_any is None:
            self.first_any = self._origin(func, "nan" if nan else "inf", False, bad, where)

    def _where(self) -> tuple[str, str | None, str | None, str | None] | None:
        node = torch._C._current_autograd_node()
        if node is not None:
            module, site = _meta(node).get(_KEY, (None, None))
            return "backward", module, site, node.name()
        site = _user_site()
        if site is _REPROKIT:
            return None
        return ("optimizer" if self.optimizing else "forward", self.stack[-1] if self.stack else None, site, None)

    def _origin(self, func: Any, value: str, created: bool, bad: list[torch.Tensor],
                where: tuple[str, str | None, str | None, str | None]) -> Origin:
        phase, module, site, node = where
        test = torch.isnan if value == "nan" else torch.isinf
        t = next((t for t in bad if bool(test(t).any())), bad[0])
        rows = None
        if self.rows and t.dim() >= 1 and t.shape[0] == self.rows:
            rows = tuple(torch.nonzero(test(t.detach()).reshape(self.rows, -1).any(1)).reshape(-1).tolist())
        return Origin(phase, str(func), value, created, module, site, node, rows)


def _meta(node: Any) -> dict[str, Any]:
    """An autograd node's metadata dict (a property at runtime; the stubs call it a method)."""
    return node.metadata  # type: ignore[no-any-return]


def stamped_module(node: Any) -> Any:
    """The module whose forward made autograd node ``node`` (stamped by an :class:`OriginWatcher`), or None."""
    return _meta(node).get(_KEY, (None, None))[0]


class _Stamp(TorchFunctionMode):
    """Stamps every new autograd node with the module and user-code line of the forward call that made it."""

    def __init__(self, watcher: OriginWatcher):
        super().__init__()
        self.watcher = watcher

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if torch.is_grad_enabled():
            roots = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            if roots and _KEY not in _meta(roots[0]):
                site = _user_site()
                stamp = (self.watcher.stack[-1] if self.watcher.stack else None,
                         None if site is _REPROKIT else site)
                # Ops inside a composite (cross_entropy = log_softmax + nll_loss) made unstamped nodes too.
                todo: list[Any] = list(roots)
                while todo:
                    node = todo.pop()
                    if node is None or _KEY in _meta(node) or "AccumulateGrad" in node.name():
                        continue
                    _meta(node)[_KEY] = stamp
                    todo.extend(fn for fn, _ in node.next_functions)
        return out


@contextmanager
def _hooks(session: Session, watcher: OriginWatcher) -> Iterator[None]:
    assert session.state is not None
    handles = []
    for name, mod in session.state.model.named_modules():
        name = name or "<model>"

        def pre(mod: Any, inputs: Any, name: str = name) -> None:
            watcher.stack.append(name)

        def post(mod: Any, inputs: Any, output: Any) -> None:
            if watcher.stack:
                watcher.stack.pop()
        handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    def opt_pre(opt: Any, args: Any, kwargs: Any) -> Any:
        watcher.optimizing = True
        closure = kwargs.get("closure", args[1] if len(args) > 1 and args[0] is opt else None)
        if not callable(closure):
            return None

        # A closure (Lightning's automatic optimization, LBFGS) runs the forward and backward inside step():
        # those are not the optimizer's ops.
        def forward_then_optimizer(*a: Any, **kw: Any) -> Any:
            watcher.optimizing = False
            try:
                return closure(*a, **kw)
            finally:
                watcher.optimizing = True
        if "closure" in kwargs:
            return args, {**kwargs, "closure": forward_then_optimizer}
        return (args[0], forward_then_optimizer, *args[2:]), kwargs

    def opt_post(*_: Any) -> None:
        watcher.optimizing = False
    opt = session.state.optimizer
    handles += [opt.register_step_pre_hook(opt_pre), opt.register_step_post_hook(opt_post)]
    step_fn = session.step_fn

    def watched(state: Any, batch: Any) -> Any:
        with _Stamp(watcher), watcher:
            return step_fn(state, batch)

    session.step_fn = watched
    try:
        yield
    finally:
        session.step_fn = step_fn
        for h in handles:
            h.remove()


def watch_step(session: Session, inp: StepInput, snapshot: tuple[dict, dict] | None,
               rows: int | None, watcher: OriginWatcher | None = None) -> tuple[RunOutcome, Origin | None]:
    """Run one step from ``snapshot`` (the state just before it) and find its origin.

    Only the step function runs watched: reprokit's batch copy and loss read do not.

    Example:
        >>> out, origin = watch_step(session, inputs[-1], before, rows=8)      # doctest: +SKIP
        >>> origin.describe()                                                  # doctest: +SKIP
        'nan made by aten.div.Tensor in the step function, outside every module at lm.py:31, forward, rows [5]'
    """
    watcher = watcher or OriginWatcher(rows)
    watcher.nan_counts = not _infinite_only(session.bundle.failure)
    with _hooks(session, watcher):
        out = session.run([inp], snapshot)
    return out, watcher.origin


def _infinite_only(failure: Any) -> bool:
    """The failure is a non-finite loss, gradient norm or parameter norm whose value is +-inf (so holds no NaN)."""
    if failure.kind not in NONFINITE:
        return False
    value = failure.message.rpartition("= ")[2].strip()
    return value in ("inf", "-inf")


def same_origin(ref: Origin, got: Origin | None, row_ids: list[int] | None) -> bool:
    """Does ``got`` (from a candidate whose batch rows are the original rows ``row_ids``) keep ``ref``?

    Same place, and no row non-finite there that was finite in the original: a cut
    that makes healthy rows go bad the same way has made a new bug, not kept the old one.
    """
    if got is None or got.place() != ref.place():
        return False
    if ref.rows is None or got.rows is None or row_ids is None:
        return True
    return all(i < len(row_ids) and row_ids[i] in ref.rows for i in got.rows)
