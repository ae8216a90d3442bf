"""Where an out-of-range index sits: the op that would fail on it, and its row and position in the batch.

A device-side assert says nothing about which value broke which op. Replayed on the CPU, the same step raises a clean
exception, and :class:`IndexWatch` checks each indexing op's indices just before it runs (a ``TorchFunctionMode``,
armed only for the step that failed): ``embedding`` (``nn.Embedding``: ids against ``num_embeddings``),
``cross_entropy`` / ``nll_loss`` (targets against the logits' class dimension, the ignore index left out),
``gather``, ``index_select``, ``take``, ``scatter``, ``index_add`` / ``index_copy`` / ``index_fill``, ``one_hot``
and indexing a tensor with an integer tensor. The first op whose indices are out of range is the finding, named
after the innermost module running it (forward hooks) and the op.

:func:`locate` then finds the finding's value in the recorded batch: the integer leaf that holds the same
out-of-range values (an id leaf for an embedding, a label leaf for a loss target), the row and position of the
value, the row's dataset index when the batch carries one, and the micro-batch of a Trainer update.

Example:
    >>> import torch
    >>> emb = torch.nn.Sequential(torch.nn.Embedding(10, 4))
    >>> batch = {"input_ids": torch.tensor([[1, 2], [3, 10]]), "index": torch.tensor([7, 8])}
    >>> with IndexWatch(emb) as watch:
    ...     try:
    ...         emb(batch["input_ids"])
    ...     except IndexError:
    ...         pass
    >>> locate(watch.finding, batch, 6)["message"]
    'step 6, input_ids row 1 (dataset index 8), position 1: id 10 >= num_embeddings 10 of 0'
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from reprokit.pytree import leaves

IGNORE_INDEX = -100
_LABELS = re.compile(r"(label|target)", re.IGNORECASE)
_NOT_IDS = re.compile(r"(^|_)(index|indices|idx|sample_id|dataset_index)$", re.IGNORECASE)
"""Leaves holding each row's dataset index: read as such, never blamed."""

Check = Callable[[tuple, dict], "dict[str, Any] | None"]


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(name, default)


def _ints(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool


def _finding(op: str, index: torch.Tensor, bad: torch.Tensor, bound: int, what: str, **extra: Any) -> dict | None:
    if not bool(bad.any()):
        return None
    flat = bad.reshape(-1)
    first = int(flat.nonzero()[0, 0])
    value = int(index.reshape(-1)[first])
    return {"op": op, "value": value, "bound": bound, "bound_name": what, "count": int(flat.sum()),
            "index_shape": list(index.shape), "rule": extra.pop("rule", "range"), **extra}


def _range(i: torch.Tensor, n: int, wrap: bool = False) -> torch.Tensor:
    """Out of ``[0, n)`` (``wrap``: of ``[-n, n)``, where negative indices count from the end)."""
    return (i < (-n if wrap else 0)) | (i >= n)


def _dim(t: torch.Tensor, dim: int) -> int:
    return dim + t.dim() if dim < 0 else dim


def _embedding(args: tuple, kwargs: dict) -> dict | None:
    ids, weight = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "weight")
    if not _ints(ids) or not isinstance(weight, torch.Tensor):
        return None
    n = int(weight.shape[0])
    return _finding("embedding", ids, _range(ids, n), n, "num_embeddings")


def _target(op: str) -> Check:
    def check(args: tuple, kwargs: dict) -> dict | None:
        logits, target = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "target")
        if not _ints(target) or not isinstance(logits, torch.Tensor) or logits.dim() == 0:
            return None  # probabilities as targets (a float tensor) index nothing
        ignore = int(_arg(args, kwargs, 4, "ignore_index", IGNORE_INDEX))
        classes = int(logits.shape[1] if logits.dim() >= 2 else logits.shape[0])
        bad = _range(target, classes) & (target != ignore)
        return _finding(op, target, bad, classes, "classes", logits_shape=list(logits.shape), ignore_index=ignore,
                        rule="target")
    return check


def _along(op: str, index_at: int, dim_at: int = 1) -> Check:
    """Ops ``op(input, dim, index, ...)``: the index against ``input.shape[dim]``."""
    def check(args: tuple, kwargs: dict) -> dict | None:
        src, dim, index = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, dim_at, "dim"), \
            _arg(args, kwargs, index_at, "index")
        if not (isinstance(src, torch.Tensor) and _ints(index) and isinstance(dim, int)) or src.dim() == 0:
            return None
        d = _dim(src, dim)
        n = int(src.shape[d])
        return _finding(op, index, _range(index, n), n, f"size of dim {d}")
    return check


def _take(args: tuple, kwargs: dict) -> dict | None:
    src, index = _arg(args, kwargs, 0, "input"), _arg(args, kwargs, 1, "index")
    if not (isinstance(src, torch.Tensor) and _ints(index)):
        return None
    n = int(src.numel())
    return _finding("take", index, _range(index, n, wrap=True), n, "elements", rule="wrap")


def _one_hot(args: tuple, kwargs: dict) -> dict | None:
    t, n = _arg(args, kwargs, 0, "tensor"), int(_arg(args, kwargs, 1, "num_classes", -1))
    if not _ints(t) or n <= 0:
        return None
    return _finding("one_hot", t, _range(t, n), n, "num_classes")


def _getitem(args: tuple, kwargs: dict) -> dict | None:
    """``x[i]`` / ``x[:, i]`` with an integer tensor ``i`` (after plain slices only)."""
    src, key = args[0], args[1] if len(args) > 1 else None
    parts = key if isinstance(key, tuple) else (key,)
    if not isinstance(src, torch.Tensor):
        return None
    for d, part in enumerate(parts):
        if _ints(part) and d < src.dim():
            n = int(src.shape[d])
            return _finding("indexing", part, _range(part, n, wrap=True), n, f"size of dim {d}", rule="wrap")
        if not isinstance(part, slice):
            return None  # an int, None or Ellipsis before it moves the dimensions: not judged
    return None


CHECKS: dict[Any, Check] = {
    F.embedding: _embedding,
    F.cross_entropy: _target("cross_entropy"),
    F.nll_loss: _target("nll_loss"),
    F.one_hot: _one_hot,
    torch.gather: _along("gather", 2), torch.Tensor.gather: _along("gather", 2),
    torch.index_select: _along("index_select", 2), torch.Tensor.index_select: _along("index_select", 2),
    torch.take: _take, torch.Tensor.take: _take,
    torch.Tensor.__getitem__: _getitem,
    torch.scatter: _along("scatter", 2), torch.Tensor.scatter: _along("scatter", 2),
    torch.Tensor.scatter_: _along("scatter", 2),
    torch.scatter_add: _along("scatter_add", 2), torch.Tensor.scatter_add: _along("scatter_add", 2),
    torch.Tensor.scatter_add_: _along("scatter_add", 2),
    torch.index_add: _along("index_add", 2), torch.Tensor.index_add: _along("index_add", 2),
    torch.Tensor.index_add_: _along("index_add", 2), torch.Tensor.index_copy_: _along("index_copy", 2),
    torch.Tensor.index_fill_: _along("index_fill", 2),
}
"""The indexing ops watched, and how each one's indices are checked."""


class IndexWatch(TorchFunctionMode):
    """Check the indices of every indexing op (:data:`CHECKS`) before it runs; keep the first out-of-range one.

    ``armed`` (default on) turns the checks on and off (a replay arms it for the failing step only); ``model``'s
    modules name the finding (``module``: the innermost one running when the op ran). Use as a context manager.
    """

    def __init__(self, model: torch.nn.Module | None = None):
        super().__init__()
        self.armed = True
        self.finding: dict[str, Any] | None = None
        self._names = {id(m): name or "<model>" for name, m in model.named_modules()} if model is not None else {}
        self._stack: list[str] = []
        self._hooks: list[Any] = []

    def __enter__(self) -> IndexWatch:
        if self._names:
            from torch.nn.modules import module as nn_module

            self._hooks = [nn_module.register_module_forward_pre_hook(self._push),
                           nn_module.register_module_forward_hook(self._pop, always_call=True)]
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        super().__exit__(*exc)

    def _push(self, module: torch.nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is not None:
            self._stack.append(name)

    def _pop(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self._names.get(id(module)) is not None and self._stack:
            self._stack.pop()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.armed and self.finding is None:
            check = CHECKS.get(func)
            if check is not None:
                try:
                    found = check(args, kwargs)
                except Exception:  # an odd call the check cannot read: the op itself runs as always
                    found = None
                if found is not None:
                    found["module"] = self._stack[-1] if self._stack else None
                    found["index"] = _indices(args, kwargs, found)
                    self.finding = found
        return func(*args, **kwargs)


def _indices(args: tuple, kwargs: dict, found: dict[str, Any]) -> torch.Tensor | None:
    """The index tensor of ``found``'s call, kept (detached, on the CPU) to find it in the batch."""
    for a in (*args, *kwargs.values(), *(args[1] if len(args) > 1 and isinstance(args[1], tuple) else ())):
        if _ints(a) and list(a.shape) == found["index_shape"] and int(a.reshape(-1).eq(found["value"]).sum()):
            return a.detach().to("cpu", copy=True)
    return None


def _bad(t: torch.Tensor, finding: dict[str, Any]) -> torch.Tensor:
    """``t``'s values out of range by ``finding``'s rule."""
    n = int(finding["bound"])
    if finding["rule"] == "target":
        return _range(t, n) & (t != int(finding.get("ignore_index", IGNORE_INDEX)))
    return _range(t, n, wrap=finding["rule"] == "wrap")


def _score(path: str, t: torch.Tensor, finding: dict[str, Any]) -> int:
    """How likely leaf ``path`` is the one the op indexed with: its shape, and its name against the op's kind."""
    name = path.rsplit("/", 1)[-1]
    score = 2 if list(t.shape) == finding["index_shape"] else 1 if t.numel() == _numel(finding["index_shape"]) else 0
    labels = bool(_LABELS.search(name))
    score += 3 if labels == (finding["rule"] == "target") else 0
    index = finding.get("index")
    if isinstance(index, torch.Tensor) and index.shape == t.shape and torch.equal(index, t.to(index.dtype)):
        score += 4
    return score


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def locate(finding: dict[str, Any] | None, batch: Any, step: int) -> dict[str, Any] | None:
    """Where ``finding``'s value sits in ``batch`` (the failing step's recorded batch): ``leaf`` (its path),
    ``micro`` (the micro-batch of a Trainer update, or None), ``row``, ``position``, ``dataset_index``, the other
    out-of-range values in the leaf (``count``, ``rows``), and ``message``, one line for people. Without a leaf that
    holds the value, the index was computed in the step: the message says so. None without a finding."""
    if finding is None:
        return None
    best: tuple[int, str, torch.Tensor, torch.Tensor] | None = None
    for path, leaf in leaves(batch):
        if not _ints(leaf) or leaf.numel() == 0 or _NOT_IDS.search(path.rsplit("/", 1)[-1]):
            continue
        t = leaf.detach().to("cpu")
        bad = _bad(t, finding) & (t == int(finding["value"]))
        if bool(bad.any()):
            score = _score(path, t, finding)
            if best is None or score > best[0]:
                best = (score, path, t, bad)
    out: dict[str, Any] = {**{k: v for k, v in finding.items() if k != "index"}, "step": step, "leaf": None,
                           "micro": None, "row": None, "position": None, "dataset_index": None, "rows": []}
    if best is None:
        out["message"] = f"step {step}: {_what(finding)} (no leaf of the batch holds it: the index was computed " \
                         "in the step)"
        return out
    _, path, t, hit = best
    flat = int(hit.reshape(-1).nonzero()[0, 0])
    where = _unravel(flat, list(t.shape))
    row = where[0] if where else None
    position = (where[1] if len(where) == 2 else tuple(where[1:])) if len(where) > 1 else None
    every = _bad(t, finding)
    rows = sorted({int(r) for r in every.reshape(t.shape[0], -1).any(dim=1).nonzero()[:, 0]}) if t.dim() else []
    parts = path.split("/")
    micro = int(parts[1]) if len(parts) > 2 and parts[0] == "micro" and parts[1].isdigit() else None
    out.update(leaf=path, micro=micro, row=row, position=position, rows=rows, count=int(every.sum()),
               dataset_index=_dataset_index(batch, path, row))
    out["message"] = _message(out, finding)
    return out


def _unravel(flat: int, shape: list[int]) -> list[int]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return idx[::-1]


def _dataset_index(batch: Any, path: str, row: int | None) -> int | None:
    """The dataset index of ``row``: a 1-D index leaf (``index``, ``idx``, ...) beside the leaf or above it."""
    if row is None:
        return None
    found = dict(leaves(batch))
    parts = path.split("/")[:-1]
    while True:
        for name in ("index", "indices", "idx", "dataset_index", "sample_id"):
            t = found.get("/".join([*parts, name]))
            if isinstance(t, torch.Tensor) and t.dim() == 1 and row < t.shape[0] and _ints(t):
                return int(t[row])
        if not parts:
            return None
        parts = parts[:-1]


def _what(finding: dict[str, Any]) -> str:
    """``id 1000 >= num_embeddings 1000 of transformer.wte``: the value against the op's bound."""
    v, n, module, op = finding["value"], finding["bound"], finding.get("module"), finding["op"]
    if op == "embedding":
        return f"id {v} >= num_embeddings {n} of {module or 'an embedding'}" if v >= 0 else \
            f"id {v} < 0 in {module or 'an embedding'}"
    if finding["rule"] == "target":
        shape = "x".join(map(str, finding.get("logits_shape") or []))
        within = f" in {module}" if module else ""
        return (f"target {v} >= {n} classes of {op} (logits {shape}){within}" if v >= 0 else
                f"target {v} < 0 in {op}, which is not its ignore_index {finding.get('ignore_index')}{within}")
    within = f" in {module}" if module else ""
    return f"index {v} out of range for {finding['bound_name']} {n} in {op}{within}"


def _message(out: dict[str, Any], finding: dict[str, Any]) -> str:
    head = [f"step {out['step']}"] + ([f"micro {out['micro']}"] if out["micro"] is not None else [])
    name = out["leaf"].rsplit("/", 1)[-1]
    where = name + (f" row {out['row']}" if out["row"] is not None else "")
    if out["dataset_index"] is not None:
        where += f" (dataset index {out['dataset_index']})"
    if out["position"] is not None:
        where += f", position {out['position']}"
    line = f"{', '.join([*head, where])}: {_what(finding)}"
    others = [r for r in out["rows"] if r != out["row"]]
    if others:
        line += f" (rows {others} hold out-of-range values too)"
    return line


__all__ = ["CHECKS", "IndexWatch", "locate"]
