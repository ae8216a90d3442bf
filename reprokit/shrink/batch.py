"""Batch surgery: the rows of a batch along its batch dimension, windows along its sequence dimension, and token
values set to neutral ones. Pure functions of pytrees of tensors; the shrink passes cut candidates with them, and
:mod:`reprokit.shrink.micro` applies them to each micro-batch of a batch of micro-batches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from reprokit.pytree import leaves

INDEX_NAMES = frozenset({"index", "indices", "idx", "sample_id"})
"""Names of a leaf that may hold each row's dataset index (see :func:`index_paths`)."""


def index_paths(batch: Any) -> frozenset[str]:
    """Paths of the leaves that hold dataset indices (never neutralised; read by :func:`dataset_indices`): a leaf
    of an index name holding integers that is 1-D (one per row) or, named other than ``idx``, 2-D ``[accum, B]``
    beside a leaf that starts with those two dimensions (stacked micro-batches). The name alone is no proof: nanoGPT
    names its token ids ``idx`` (``[B, T]``, beside ``targets: [B, T]`` and maybe a ``[B, T, T]`` mask); those are
    data.

    Example:
        >>> sorted(index_paths({"idx": torch.zeros(2, 5, dtype=torch.long), "index": torch.arange(2)}))
        ['index']
    """
    found = leaves(batch)
    out = set()
    for path, leaf in found:
        name = path.rsplit("/", 1)[-1]
        if name not in INDEX_NAMES or not isinstance(leaf, torch.Tensor) or leaf.is_floating_point() \
                or leaf.is_complex() or leaf.dtype == torch.bool:
            continue
        if leaf.dim() <= 1 or (leaf.dim() == 2 and name != "idx" and any(
                isinstance(o, torch.Tensor) and o.dim() >= 3 and tuple(o.shape[:2]) == tuple(leaf.shape)
                for _, o in found)):
            out.add(path)
    return frozenset(out)


def tensor_leaves(batch: Any) -> list[torch.Tensor]:
    """The batch's tensor leaves, in tree order."""
    return [leaf for _, leaf in leaves(batch) if isinstance(leaf, torch.Tensor)]


def batch_size(batch: Any) -> int | None:
    """The number of rows: the most common leading dimension among tensor leaves (ties: the larger).

    A list of per-sample items (one ``[C, H, W]`` image or one target dict per sample, as detection collates
    make) is one vote for its length, and its items share one vote between them: eight 3-channel images are a
    batch of 8, not of 3.

    Example:
        >>> batch_size({"images": [torch.zeros(3, 6) for _ in range(8)], "y": torch.zeros(8)})
        8
    """
    votes: dict[int, float] = {}
    _vote(batch, 1.0, votes)
    return max(votes, key=lambda k: (votes[k], k)) if votes else None


def _vote(node: Any, weight: float, votes: dict[int, float]) -> None:
    if isinstance(node, torch.Tensor):
        if node.dim() >= 1:
            votes[node.shape[0]] = votes.get(node.shape[0], 0.0) + weight
    elif isinstance(node, Mapping):
        for v in node.values():
            _vote(v, weight, votes)
    elif isinstance(node, (list, tuple)) and node:
        items = all(isinstance(v, (torch.Tensor, Mapping)) for v in node) and len(node) >= 2
        if items and _per_sample(node, None):
            votes[len(node)] = votes.get(len(node), 0.0) + weight
        for v in node:
            _vote(v, weight / len(node) if items else weight, votes)


def _per_sample(items: list | tuple, n: int | None) -> bool:
    """``items`` (``n`` of them, when given) are one entry per row: tensors or dicts, not all of them tensors
    whose own leading dimension is the number of rows (``(x, y)`` is two batched tensors, not two samples).

    Guessing the row count (``n`` not given), tensors that all lead with 1 are a batch of one row: the ``(x, y)``
    a shrink leaves, not two samples (read as two, the rows pass indexed past the one row it had kept)."""
    if (n is not None and len(items) != n) or not items:
        return False
    if not all(isinstance(v, (torch.Tensor, Mapping)) for v in items):
        return False
    if n is None and all(isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == 1 for v in items):
        return False
    rows = n if n is not None else len(items)
    return not all(isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == rows for v in items)


TOKEN_DTYPES = frozenset({torch.int32, torch.int64})
"""Integer dtypes that carry token ids (uint8 images and bool masks are not sequences)."""


def seq_len(batch: Any, n: int | None) -> int | None:
    """The sequence length: the most common dim 1 among ``[n, S, ...]`` integer token tensors.

    Only token tensors define it: a dense float input ``[n, 64]`` has features along
    dim 1, not positions, and a batch without token tensors has no sequence at all.
    """
    sizes = Counter(t.shape[1] for t in tensor_leaves(batch) if t.dim() >= 2 and t.dtype in TOKEN_DTYPES
                    and (n is None or t.shape[0] == n))
    return max(sizes, key=lambda k: (sizes[k], k)) if sizes else None


def select_rows(batch: Any, n: int, keep: list[int]) -> Any:
    """Keep rows ``keep`` of every leaf with leading dimension ``n`` (tensors, lists of scalars, and lists of
    per-sample tensors or dicts)."""
    if isinstance(batch, torch.Tensor):
        return batch[torch.tensor(keep, dtype=torch.long, device=batch.device)] \
            if batch.dim() >= 1 and batch.shape[0] == n else batch
    if isinstance(batch, Mapping):
        return {k: select_rows(v, n, keep) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        if len(batch) == n and (all(isinstance(v, (str, int, float, bool)) or v is None for v in batch)
                                or _per_sample(batch, n)):
            return type(batch)(batch[i] for i in keep)
        return type(batch)(select_rows(v, n, keep) for v in batch)
    return batch


def select_seq(batch: Any, n: int | None, s: int, lo: int, hi: int) -> Any:
    """Slice ``[:, lo:hi]`` out of every ``[n, s, ...]`` tensor leaf: the token tensors (``s`` is their
    :func:`seq_len`) and the leaves sharing their length (masks, labels, per-position features).

    A position-by-position mask (a 4-D attention mask ``[n, 1, s, s]`` or ``[n, heads, s, s]``, of any dtype, or
    a boolean or integer ``[n, s, s]``) has both of its last two dimensions cut, which leaves the mask over the
    kept positions. A floating ``[n, s, s]`` is cut along dim 1 only: it may be features whose width happens to
    equal ``s``. A broadcast padding mask ``[n, 1, 1, s]`` is cut along its last dimension."""
    if isinstance(batch, torch.Tensor):
        if batch.dim() < 2 or (n is not None and batch.shape[0] != n):
            return batch
        pairwise = batch.dim() >= 4 or (batch.dim() == 3 and not batch.is_floating_point())
        if pairwise and batch.shape[-2:] == (s, s):
            return batch[..., lo:hi, lo:hi].contiguous()
        if batch.dim() >= 3 and batch.shape[-1] == s and all(d == 1 for d in batch.shape[1:-1]):
            return batch[..., lo:hi].contiguous()  # a broadcast padding mask [n, 1, 1, s]
        return batch[:, lo:hi].contiguous() if batch.shape[1] == s else batch
    if isinstance(batch, Mapping):
        return {k: select_seq(v, n, s, lo, hi) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(select_seq(v, n, s, lo, hi) for v in batch)
    return batch


def concat_rows(a: Any, n: int, b: Any) -> Any:
    """``a`` (``n`` rows) with the rows of ``b`` (the same structure, one row) appended; None if they do not fit."""
    if isinstance(a, torch.Tensor):
        if a.dim() == 0 or a.shape[0] != n:
            return a
        if not isinstance(b, torch.Tensor) or b.dtype != a.dtype or b.shape[1:] != a.shape[1:]:
            return None
        return torch.cat([a, b.to(a.device)])
    if isinstance(a, Mapping):
        if not isinstance(b, Mapping) or set(a) != set(b):
            return None
        out = {k: concat_rows(v, n, b[k]) for k, v in a.items()}
        return None if any(v is None and a[k] is not None for k, v in out.items()) else out
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)):
            return None
        if len(a) == n and (all(isinstance(v, (str, int, float, bool)) or v is None for v in a)
                            or _per_sample(a, n)):
            return type(a)([*a, *b]) if len(b) == 1 else None
        if len(a) != len(b):
            return None
        parts = [concat_rows(x, n, y) for x, y in zip(a, b)]
        return None if any(p is None and x is not None for p, x in zip(parts, a)) else type(a)(parts)
    return a


def _eligible(path: str, leaf: Any, index: frozenset[str]) -> bool:
    return (isinstance(leaf, torch.Tensor) and leaf.dtype != torch.bool and leaf.numel() > 0
            and not leaf.is_complex() and path not in index)


def _neutral(t: torch.Tensor, pad_id: int) -> float | int:
    return 0.0 if t.is_floating_point() else pad_id


def token_positions(batch: Any, pad_id: int) -> list[tuple[str, int]]:
    """``(leaf path, flat index)`` of every value that is not already neutral."""
    out: list[tuple[str, int]] = []
    index = index_paths(batch)
    for path, leaf in leaves(batch):
        if _eligible(path, leaf, index):
            flat = leaf.detach().reshape(-1)
            idx = torch.nonzero(flat != _neutral(leaf, pad_id)).reshape(-1).tolist()
            out.extend((path, i) for i in idx)
    return out


def neutralise(batch: Any, keep: set[tuple[str, int]], pad_id: int) -> Any:
    """Set every eligible value not in ``keep`` to its neutral value (0, or ``pad_id`` for integers); dataset
    indices (:func:`index_paths`) and boolean masks are kept."""
    return _neutralise(batch, keep, pad_id, "", index_paths(batch))


def _neutralise(batch: Any, keep: set[tuple[str, int]], pad_id: int, path: str, index: frozenset[str]) -> Any:
    if isinstance(batch, Mapping):
        return {k: _neutralise(v, keep, pad_id, f"{path}/{k}" if path else str(k), index) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_neutralise(v, keep, pad_id, f"{path}/{i}" if path else str(i), index)
                           for i, v in enumerate(batch))
    leaf_path = path or "<root>"
    if not _eligible(leaf_path, batch, index):
        return batch
    flat = batch.detach().clone().reshape(-1)
    mask = torch.ones(flat.numel(), dtype=torch.bool)
    kept = [i for p, i in keep if p == leaf_path]
    if kept:
        mask[torch.tensor(kept, dtype=torch.long)] = False
    flat[mask.to(flat.device)] = _neutral(batch, pad_id)
    return flat.reshape(batch.shape)


def dataset_indices(batch: Any, rows: tuple[int, ...] | None) -> list[Any] | None:
    """Values of an ``index``-like leaf at the kept rows, when the batch carries one."""
    if rows is None:
        return None
    index = index_paths(batch)
    for path, leaf in leaves(batch):
        if path in index and leaf.dim() == 1 and rows and max(rows) < leaf.shape[0]:
            values = leaf.tolist()
            return [values[i] for i in rows]
    return None


def mix_rows(batch: Any, donor: Any, n: int, rows: list[int]) -> Any | None:
    """``batch``'s rows ``rows`` at their positions and ``donor``'s rows everywhere else: a batch of ``batch``'s
    shapes in which only those rows are its own. ``donor`` has ``batch``'s structure and shapes (another step's
    batch); leaves without a row dimension are ``batch``'s. None when the two do not fit together.

    Example:
        >>> mix_rows({"x": torch.tensor([1, 2, 3])}, {"x": torch.tensor([7, 8, 9])}, 3, [1])
        {'x': tensor([7, 2, 9])}
    """
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] != n:
            return batch
        if not isinstance(donor, torch.Tensor) or donor.shape != batch.shape or donor.dtype != batch.dtype:
            return None
        out = donor.to(batch.device, copy=True)
        if rows:
            at = torch.tensor(rows, dtype=torch.long, device=batch.device)
            out[at] = batch[at]
        return out
    if isinstance(batch, Mapping):
        if not isinstance(donor, Mapping) or set(batch) != set(donor):
            return None
        out_map = {k: mix_rows(v, donor[k], n, rows) for k, v in batch.items()}
        return None if any(v is None and batch[k] is not None for k, v in out_map.items()) else out_map
    if isinstance(batch, (list, tuple)):
        if not isinstance(donor, (list, tuple)) or len(donor) != len(batch):
            return None
        if len(batch) == n and (all(isinstance(v, (str, int, float, bool)) or v is None for v in batch)
                                or _per_sample(batch, n)):
            keep = set(rows)
            return type(batch)(batch[i] if i in keep else donor[i] for i in range(n))
        parts = [mix_rows(x, y, n, rows) for x, y in zip(batch, donor)]
        return None if any(p is None and x is not None for p, x in zip(parts, batch)) else type(batch)(parts)
    return batch


def mask_rows(batch: Any, n: int, rows: list[int], pad_id: int) -> Any:
    """``batch`` with every value outside rows ``rows`` set to its neutral value (0, or ``pad_id`` for integers), in
    each tensor leaf with ``n`` rows that :func:`neutralise` would touch (dataset indices and boolean masks are kept):
    the batch's shapes, only those rows' values."""
    keep: set[tuple[str, int]] = set()
    index = index_paths(batch)
    for path, leaf in leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 1 and leaf.shape[0] == n and _eligible(path, leaf, index):
            per_row = leaf[0].numel()
            keep.update((path, r * per_row + i) for r in rows for i in range(per_row))
        elif _eligible(path, leaf, index):
            keep.update((path, i) for i in range(leaf.numel()))  # not per row: left as it is
    return neutralise(batch, keep, pad_id)
