"""Split a Python tree into JSON plus a flat dict of tensors, and back.

Batches and ``state_dict()``s are trees of tensors, numbers, strings, lists,
tuples and dicts (optimizer state uses ``int`` keys). Tensors go to a
safetensors file under path-like keys; everything else stays in JSON, tagged
where JSON alone would lose the type (tuples, non-string keys, NaN/inf).
Nothing is pickled, so nothing can run code on load.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from reprokit.errors import CaptureError

if TYPE_CHECKING:
    import torch

# torch is imported by the functions that make tensors (encode), not here: decoding a tree whose tensors
# were read as numpy arrays (``reprokit inspect``) must not pay torch's import, which takes seconds.

TENSOR = "__rk_tensor__"
NDARRAY = "__rk_ndarray__"
TUPLE = "__rk_tuple__"
DICT = "__rk_dict__"
FLOAT = "__rk_float__"
TAGS = (TENSOR, NDARRAY, TUPLE, DICT, FLOAT)

TensorCopy = Callable[["torch.Tensor"], "torch.Tensor"]


def _default_copy(t: torch.Tensor) -> torch.Tensor:
    # A fresh, contiguous CPU copy: the caller keeps training and mutating `t`.
    return t.detach().to("cpu", copy=True).contiguous()


def encode(
    obj: Any,
    prefix: str = "",
    *,
    copy: TensorCopy = _default_copy,
    skip_callables: bool = False,
    tensors: dict[str, torch.Tensor] | None = None,
    shards: dict[str, dict[str, Any]] | None = None,
) -> tuple[Any, dict[str, torch.Tensor]]:
    """Split ``obj`` into a JSON-able tree and ``{key: tensor}``.

    Args:
        obj: the tree to encode.
        prefix: prepended to every tensor key (``"model"`` gives ``"model/fc.weight"``).
        copy: how a tensor leaf is copied (default: detached contiguous CPU copy).
        skip_callables: drop callables silently (scheduler state holds lambdas
            that ``build`` recreates anyway).
        tensors: an existing dict to add the tensors to.
        shards: where to describe sharded leaves (``DTensor``, as FSDP2 makes them): this rank's local shard is
            stored under the leaf's key, and ``shards[key]`` says how it was laid out (see :func:`shard_spec`).
            Without it a DTensor leaf is refused: a batch or an RNG tree has no business holding one.

    Returns:
        ``(tree, tensors)``; ``decode(tree, tensors)`` gives back an equal tree.

    Raises:
        CaptureError: for a leaf that is neither a tensor, an array nor plain data,
            naming its path.

    Example:
        >>> import torch
        >>> tree, ts = encode({"x": torch.ones(2), "n": 3})
        >>> decode(tree, ts)["n"]
        3
    """
    out: dict[str, torch.Tensor] = {} if tensors is None else tensors
    return _enc(obj, prefix, out, copy, skip_callables, shards), out


def _enc(obj: Any, path: str, out: dict, copy: TensorCopy, skip: bool, shards: dict | None = None) -> Any:
    import torch  # already loaded wherever a tree is encoded: ~0.1 us a leaf

    if isinstance(obj, torch.Tensor):  # first: state dicts are mostly tensors (snapshots walk ~1000 leaves)
        if obj.layout != torch.strided:
            raise CaptureError(f"{path or '<root>'}: sparse tensors are not supported; make it dense with `.to_dense()`")
        key = path or "tensor"
        if type(obj) is not torch.Tensor and is_dtensor(obj):
            if shards is None:
                raise CaptureError(f"{path or '<root>'}: a sharded DTensor can be recorded only in the training state")
            shards[key] = shard_spec(obj)
            obj = obj.to_local()  # type: ignore[attr-defined]
        out[key] = copy(obj)
        return {TENSOR: key}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {FLOAT: repr(obj)}
    if isinstance(obj, np.ndarray):
        key = path or "array"
        out[key] = torch.from_numpy(np.ascontiguousarray(obj)).clone()
        return {NDARRAY: key}
    if isinstance(obj, np.generic):
        return _enc(obj.item(), path, out, copy, skip)
    if isinstance(obj, tuple):
        return {TUPLE: [_enc(v, f"{path}/{i}", out, copy, skip, shards) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_enc(v, f"{path}/{i}", out, copy, skip, shards) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        items = [(k, v) for k, v in obj.items() if not (skip and callable(v) and not isinstance(v, torch.Tensor))]
        if all(isinstance(k, str) and k not in TAGS for k, _ in items):
            return {k: _enc(v, f"{path}/{k}" if path else k, out, copy, skip, shards) for k, v in items}
        return {DICT: [[_enc(k, f"{path}/#key{i}", out, copy, skip, shards), _enc(v, f"{path}/{k}", out, copy, skip, shards)]
                       for i, (k, v) in enumerate(items)]}
    raise CaptureError(
        f"{path or '<root>'}: cannot record a value of type {type(obj).__qualname__}; "
        "bundles hold only tensors, numpy arrays, numbers, strings, None, and lists/tuples/dicts of those"
    )


_DTENSOR: type | None = None


def dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor`` (``torch.distributed._tensor`` before torch 2.5, where FSDP2 is
    ``torch.distributed._composable.fsdp``); None for a torch built without distributed support."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor  # torch 2.4
        except ImportError:
            return None
    return DTensor  # type: ignore[no-any-return]


def is_dtensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (:func:`dtensor_class`, imported only once a tensor subclass shows up)."""
    global _DTENSOR
    if _DTENSOR is None:
        _DTENSOR = dtensor_class()
        if _DTENSOR is None:
            return False
    return isinstance(t, _DTENSOR)


def shard_spec(t: Any) -> dict[str, Any]:
    """How a DTensor is laid out: JSON that replay compares with the DTensor it loads the local shard into."""
    return {"placements": [repr(p) for p in t.placements], "shape": list(t.shape),
            "local_shape": list(t.to_local().shape), "mesh_shape": list(t.device_mesh.shape)}


def decode(tree: Any, tensors: Mapping[str, Any]) -> Any:
    """Inverse of :func:`encode`. ``tensors`` may hold torch tensors or numpy arrays (read without torch)."""
    if isinstance(tree, list):
        return [decode(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        (tag, val), = tree.items()
        if tag == TENSOR:
            return tensors[val]
        if tag == NDARRAY:
            t = tensors[val]
            return t if isinstance(t, np.ndarray) else t.numpy()
        if tag == TUPLE:
            return tuple(decode(v, tensors) for v in val)
        if tag == DICT:
            return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in val}
        if tag == FLOAT:
            return float(val)
    return {k: decode(v, tensors) for k, v in tree.items()}


def _hashable(key: Any) -> Any:
    return tuple(_hashable(k) for k in key) if isinstance(key, (list, tuple)) else key


def leaves(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf of a decoded tree (containers walked)."""
    if isinstance(obj, Mapping):
        return [x for k, v in obj.items() for x in leaves(v, f"{path}/{k}" if path else str(k))]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in leaves(v, f"{path}/{i}" if path else str(i))]
    return [(path or "<root>", obj)]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor leaf of a decoded tree, keeping its shape."""
    import torch

    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    return obj
