"""Batches made of micro-batches (gradient accumulation): their rows are ``(micro-batch, row)`` pairs.

Two layouts are known:

* a list: ``{"micro": [{"inputs": ..., "index": LongTensor[B]}, ...]}``, one entry per micro-batch, as the
  Hugging Face integration records an optimizer update (:data:`MICRO`);
* stacked: every per-sample leaf is ``[accum, B, ...]`` (a nanoGPT-style loop that indexes ``x[k]``). The
  dataset index leaf says so: an ``index`` leaf of shape ``[accum, B]`` gives the two leading dimensions,
  and the leaves that start with them are the stacked ones.

Rows are cut in each micro-batch on its own (a row of micro-batch 1 is not a row of micro-batch 0), a
micro-batch left without rows is dropped, and a row's dataset index is read from its own micro-batch.
Stacked micro-batches must keep the same row count (they are one tensor): a cut that leaves them ragged
cannot be built and counts as not failing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from reprokit import pytree
from reprokit.shrink.batch import TOKEN_DTYPES, batch_size, dataset_indices, index_paths, select_rows, select_seq, seq_len

MICRO = "micro"
"""The key of the micro-batch list (``reprokit.integrations.transformers.MICRO``)."""


@dataclass(frozen=True)
class Layout:
    """How a batch holds its micro-batches: ``kind`` is ``list`` or ``stacked`` (``paths``: the stacked leaves)."""

    kind: str
    paths: frozenset[str] = frozenset()


def layout(batch: Any) -> Layout | None:
    """The batch's micro-batch layout, or None for an ordinary batch (rows along dim 0)."""
    if isinstance(batch, Mapping) and isinstance(batch.get(MICRO), list) and batch[MICRO] \
            and all(isinstance(m, Mapping) for m in batch[MICRO]):
        return Layout("list")
    index = stacked_index(batch)
    if index is None:
        return None
    lead = tuple(index.shape[:2])
    paths = frozenset(p for p, leaf in pytree.leaves(batch)
                      if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and tuple(leaf.shape[:2]) == lead)
    return Layout("stacked", paths)


def ambiguous(batch: Any) -> str | None:
    """Why the batch's row dimension cannot be told, or None: 3-D token ids (``[accum, B, T]``
    or ``[B, T, K]``?) with no dataset index leaf to say which dimensions are the rows."""
    if layout(batch) is not None:
        return None
    found = pytree.leaves(batch)
    index = index_paths(batch)
    if any(path in index and leaf.dim() == 1 for path, leaf in found):
        return None  # a [B] index: rows are dim 0
    for path, leaf in found:
        # exactly 3-D: a 4-D integer leaf is a position-by-position mask [B, heads, T, T]; masks are not ids
        if isinstance(leaf, torch.Tensor) and leaf.dtype in TOKEN_DTYPES and leaf.dim() == 3 \
                and "mask" not in path.rsplit("/", 1)[-1].lower():
            return (f"{path} is {str(leaf.dtype).replace('torch.', '')}{list(leaf.shape)}: its rows may be dim 0, or "
                    f"dims 0 and 1 (stacked micro-batches [accum, B, T]), and no dataset index leaf says which, so "
                    f"rows and sequence were not cut; add a leaf named `index` of shape [accum, B] (or [B]) to the "
                    f"batch to tell")
    return None


def stacked_index(batch: Any) -> torch.Tensor | None:
    """The dataset index leaf when it is 2-D (``[accum, B]``) and another leaf of 3 or more dimensions starts with
    ``[accum, B]`` (``x: [accum, B, T]``): the batch is stacked micro-batches. A 2-D leaf of an index name alone is
    no proof: nanoGPT names its token ids ``idx`` (``[B, T]``, beside ``targets: [B, T]``), an ordinary batch."""
    index = index_paths(batch)  # a 2-D one there has such a sibling (and is not nanoGPT's token ids, ``idx``)
    return next((leaf for path, leaf in pytree.leaves(batch) if path in index and leaf.dim() == 2), None)


def split(batch: Any, lay: Layout) -> list[Any]:
    """The micro-batches, each an ordinary batch (rows along dim 0)."""
    if lay.kind == "list":
        return list(batch[MICRO])
    leaves = dict(pytree.leaves(batch))
    accum = next(leaves[p].shape[0] for p in sorted(lay.paths))
    return [_replace(batch, lambda p, leaf, k=k: leaf[k] if p in lay.paths else leaf) for k in range(accum)]


def join(batch: Any, lay: Layout, micros: list[Any]) -> Any | None:
    """``batch`` with ``micros`` as its micro-batches; None when stacked ones no longer fit one tensor."""
    if lay.kind == "list":
        return {**batch, MICRO: micros}
    parts = [dict(pytree.leaves(m)) for m in micros]
    for p in lay.paths:
        if len({tuple(part[p].shape) for part in parts}) != 1:
            return None
    return _replace(batch, lambda p, leaf: torch.stack([part[p] for part in parts]) if p in lay.paths else leaf)


def units(batch: Any, lay: Layout) -> tuple[tuple[int, int], ...]:
    """Every row as ``(micro-batch, row)``."""
    return tuple((k, r) for k, m in enumerate(split(batch, lay)) for r in range(batch_size(m) or 0))


def select(batch: Any, lay: Layout, current: tuple[tuple[int, int], ...], keep: list[tuple[int, int]]) -> Any | None:
    """Keep the rows ``keep`` of ``batch``, whose rows are the original ``current`` pairs in order."""
    micros = split(batch, lay)
    order = list(dict.fromkeys(k for k, _ in current))  # original micro-batch ids, in the batch's order
    wanted = set(keep)
    out = []
    for i, k in enumerate(order):
        rows = [r for kk, r in current if kk == k]
        picked = [j for j, r in enumerate(rows) if (k, r) in wanted]
        if picked:
            out.append(select_rows(micros[i], len(rows), picked))
    return join(batch, lay, out) if out else None


def cut_seq(batch: Any, lay: Layout, s: int, lo: int, hi: int) -> Any | None:
    """``[lo, hi)`` of the sequence of every micro-batch."""
    micros = split(batch, lay)
    return join(batch, lay, [select_seq(m, batch_size(m), s, lo, hi) for m in micros])


def seq_of(batch: Any, lay: Layout) -> int | None:
    """The sequence length of the micro-batches (of the first)."""
    first = split(batch, lay)[0]
    return seq_len(first, batch_size(first))


def indices(batch: Any, lay: Layout, rows: tuple[tuple[int, int], ...]) -> list[Any] | None:
    """Each kept row's dataset index, read from its own micro-batch (:func:`dataset_indices` of that one)."""
    micros = split(batch, lay)
    out = []
    for k, r in rows:
        found = dataset_indices(micros[k], (r,))
        if found is None:
            return None
        out.append(found[0])
    return out


def _replace(tree: Any, fn: Any, path: str = "") -> Any:
    """``tree`` with each leaf replaced by ``fn(path, leaf)`` (paths as :func:`reprokit.pytree.leaves` writes them)."""
    if isinstance(tree, Mapping):
        return {k: _replace(v, fn, f"{path}/{k}" if path else str(k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_replace(v, fn, f"{path}/{i}" if path else str(i)) for i, v in enumerate(tree))
    return fn(path or "<root>", tree)
