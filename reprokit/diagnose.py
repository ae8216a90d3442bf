"""A diagnosis of the failing step's batch, before any replay: what a person checks first.

Four classic data faults show in the batch alone, given the sizes of the model's lookup tables:

- non-finite values in a floating leaf (per leaf and row);
- an integer id past the model's ``nn.Embedding`` tables (a tokenizer/model vocab mismatch), or a
  negative id other than the ignore index;
- rows whose mask keeps no position (all 0; for PyTorch's ``key_padding_mask``, where true means
  "leave out", all true; other padding masks are written both ways and are not judged) or whose
  labels are all the ignore index (a loss of 0/0);
- a sequence longer than the position table (a rare long sample).

The table sizes come from the recorder (:func:`model_tables`, stored as ``run.json``'s ``model``),
so ``inspect`` never imports the bundle's code. Which integer leaf feeds which table cannot be known
without running the code, so an id leaf is held against the *largest* token table: an id that fits
no table at all is out of range whichever table it feeds. Leaves named like dataset indices
(``index``, ``idx``), media (``pixel_values``, ``images``, ``audio``) or amounts (``lengths``,
``num_tokens``) are not ids and are skipped, and so are 1-D labels (one class per sample: they index
the classifier's outputs, not a token table). Everything here only reads tensors and never raises on
odd input (a finding that cannot be computed is left out).

Example:
    >>> import torch
    >>> tables = {"embeddings": [{"name": "wte", "num_embeddings": 64, "padding_idx": None}], "positions": []}
    >>> [f["message"] for f in findings({"input_ids": torch.tensor([[1, 64]])}, tables)]
    ['input_ids row 0 position 1 = 64 >= num_embeddings 64 of wte']
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# The checks run on numpy arrays: ``inspect`` reads the batch with safetensors' numpy backend and never
# imports torch (it must answer in under a second). Torch tensors (the recorder's batch, or a step file holding
# bf16) are turned into arrays first (:func:`_array`).

IGNORE_INDEX = -100
"""The ignore index of ``cross_entropy`` (and of Hugging Face labels)."""
MAX_FINDINGS = 20
"""At most this many findings are listed; the rest are counted."""

_POSITION = re.compile(r"(^|[._])(pos|wpe|position)", re.IGNORECASE)
_NOT_IDS = re.compile(r"(index|idx|pixel|image|img|video|frame|audio|wav)", re.IGNORECASE)
"""Integer leaves that are not ids: dataset indices, and media (uint8 images, PCM audio) whose values are levels."""
_AMOUNTS = re.compile(r"^(n|num)_|(^|_)(len|lens|length|lengths|count|counts|size|sizes)$", re.IGNORECASE)
"""Integer leaves that count something (``lengths``, ``num_tokens``, ``seq_len``): amounts, not ids."""
_MASK = re.compile(r"mask", re.IGNORECASE)
_KEY_PADDING = re.compile(r"key_padding_mask", re.IGNORECASE)
"""PyTorch's padding masks (``key_padding_mask``, ``src_key_padding_mask``): true marks a position to *leave out*."""
_NOT_EMPTY_CHECKED = re.compile(r"special|pad", re.IGNORECASE)
"""``special_tokens_mask`` marks special tokens (a row without any is an ordinary row); other padding masks are
written both ways (true = padding, or ``tokens != pad_id``), so an all-0 or all-1 row says nothing sure."""
_LABELS = re.compile(r"(label|target)", re.IGNORECASE)


def model_tables(model: torch.nn.Module) -> dict[str, list[dict[str, Any]]]:
    """The model's lookup tables: token ``nn.Embedding``s and position tables (recorder side).

    A position table is an ``nn.Embedding`` or a 2-D parameter/buffer whose name says ``pos``,
    ``wpe`` or ``position``; its first dimension is the longest sequence it serves.

    Example:
        >>> import torch
        >>> model_tables(torch.nn.Embedding(10, 4))["embeddings"][0]["num_embeddings"]
        10
    """
    import torch

    embeddings: list[dict[str, Any]] = []
    positions: list[dict[str, Any]] = []
    owned: set[str] = set()
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Embedding):
            entry = {"name": name or "<model>", "num_embeddings": int(mod.num_embeddings),
                     "padding_idx": None if mod.padding_idx is None else int(mod.padding_idx)}
            (positions if _POSITION.search(name) else embeddings).append(entry)
            owned.add(f"{name}.weight" if name else "weight")
    named = [*model.named_parameters(), *model.named_buffers()]
    for name, t in named:
        if name not in owned and t.dim() == 2 and _POSITION.search(name):
            positions.append({"name": name, "num_embeddings": int(t.shape[0]), "padding_idx": None})
    return {"embeddings": embeddings, "positions": positions}


def _leaves(obj: Any, path: str = "") -> list[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        return [x for k, v in obj.items() for x in _leaves(v, f"{path}/{k}" if path else str(k))]
    if isinstance(obj, (list, tuple)):
        return [x for i, v in enumerate(obj) for x in _leaves(v, f"{path}/{i}" if path else str(i))]
    return [(path or "<root>", obj)]


def _array(leaf: Any) -> np.ndarray | None:
    """A leaf as a numpy array: an array as it is, a dense torch tensor copied to the host, else None."""
    if isinstance(leaf, np.ndarray):
        return leaf
    torch = sys.modules.get("torch")  # a torch tensor exists only once torch is imported: never import it here
    if torch is None or not isinstance(leaf, torch.Tensor) or leaf.layout != torch.strided:
        return None
    t = leaf.detach().cpu().resolve_conj().resolve_neg()
    if t.is_floating_point() and t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.float()  # bf16 and float8 have no numpy dtype; float32 holds each of their values, NaN and inf
    elif t.dtype == torch.complex32:
        t = t.to(torch.complex64)
    return t.numpy()


def _rows(t: np.ndarray) -> np.ndarray:
    """``t`` as ``[rows, -1]`` (a 0-d or 1-d array is one row)."""
    return t.reshape(1, -1) if t.ndim <= 1 else t.reshape(t.shape[0], -1)


def _where(t: np.ndarray, flat: int) -> str:
    """``row R position P`` of a flat index into ``t``."""
    if t.ndim == 0:
        return ""
    idx = []
    for size in reversed(t.shape):
        idx.append(flat % size)
        flat //= size
    idx.reverse()
    if len(idx) == 1:
        return f" position {idx[0]}"
    rest = idx[1:]
    return f" row {idx[0]} position {rest[0] if len(rest) == 1 else tuple(rest)}"


def findings(batch: Any, tables: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """Every data fault found in ``batch``: ``[{"leaf", "row", "check", "message"}]``.

    Leaves may be numpy arrays or torch tensors. ``check`` is one of ``nonfinite``, ``id_range``,
    ``negative_id``, ``empty_mask``, ``all_ignored``, ``sequence_length``. ``tables`` is
    :func:`model_tables`'s dict (or None: id checks are skipped).
    """
    out: list[dict[str, Any]] = []
    tables = tables if isinstance(tables, Mapping) else {}
    embeddings = [e for e in tables.get("embeddings") or [] if isinstance(e, Mapping)]
    positions = [e for e in tables.get("positions") or [] if isinstance(e, Mapping)]
    for path, leaf in _leaves(batch):
        try:
            t = _array(leaf)
            if t is None or t.size == 0:
                continue
            kind = t.dtype.kind
            if kind in "fc":
                out += _nonfinite(path, t)
            elif kind in "iu" and not _NOT_IDS.search(path):
                if _LABELS.search(path):
                    out += _all_ignored(path, t)
                if not _MASK.search(path) and not _AMOUNTS.search(path.rsplit("/", 1)[-1]):
                    # A 1-D label is a class per sample (it indexes the classifier's outputs, not a token table).
                    per_sample = bool(_LABELS.search(path)) and t.ndim < 2
                    out += _ids(path, t, [] if per_sample else embeddings, positions)
            if _MASK.search(path) and kind in "biuc":
                if _KEY_PADDING.search(path):
                    out += _empty_masks(path, t, padding=True)
                elif not _NOT_EMPTY_CHECKED.search(path):
                    out += _empty_masks(path, t)
        except (RuntimeError, TypeError, ValueError):
            continue  # an odd leaf (say, a dtype without comparisons): no finding rather than a crash
    return out


def _nonfinite(path: str, t: np.ndarray) -> list[dict[str, Any]]:
    bad = ~np.isfinite(t)
    if not bad.any():
        return []
    rows = _rows(bad)
    nan = _rows(np.isnan(t))
    out = []
    for r in np.flatnonzero(rows.any(axis=1)).tolist():
        n_nan, n_all = int(nan[r].sum()), int(rows[r].sum())
        first = int(np.flatnonzero(rows[r])[0])
        where = f" row {r}" if t.ndim > 1 else ""
        at = f", first at position {first}" if t.ndim > 1 else f" at position {first}"
        out.append({"leaf": path, "row": r if t.ndim > 1 else None, "check": "nonfinite",
                    "message": f"{path}{where}: {n_nan} NaN and {n_all - n_nan} inf value(s){at}"})
    return out


def _ids(path: str, t: np.ndarray, embeddings: list[Mapping[str, Any]],
         positions: list[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    flat = t.reshape(-1).astype(np.int64)
    negative = (flat < 0) & (flat != IGNORE_INDEX)
    if negative.any():
        i = int(np.flatnonzero(negative)[0])
        raises = "cross_entropy raises unless it is its ignore_index" if _LABELS.search(path) else \
            "an embedding lookup raises IndexError"
        out.append({"leaf": path, "row": _row(t, i), "check": "negative_id",
                    "message": f"{path}{_where(t, i)} = {int(flat[i])} < 0 ({raises}; "
                               f"only {IGNORE_INDEX} is the usual ignore index)"})
    if embeddings:
        table = max(embeddings, key=lambda e: int(e.get("num_embeddings", 0)))
        size = int(table.get("num_embeddings", 0))
        over = flat >= size
        for i in np.flatnonzero(over)[:5].tolist():
            out.append({"leaf": path, "row": _row(t, i), "check": "id_range",
                        "message": f"{path}{_where(t, i)} = {int(flat[i])} >= num_embeddings {size} of "
                                   f"{table.get('name')}"})
        if int(over.sum()) > 5:
            out.append({"leaf": path, "row": None, "check": "id_range",
                        "message": f"{path}: {int(over.sum())} ids >= {size} in all (first 5 listed)"})
    if positions and t.ndim >= 2 and not _LABELS.search(path):
        length = int(t.shape[-1])
        for table in positions:
            size = int(table.get("num_embeddings", 0))
            if length > size:
                out.append({"leaf": path, "row": None, "check": "sequence_length",
                            "message": f"{path}: sequence length {length} > {size} positions of {table.get('name')} "
                                       f"(the longest sequence the model takes)"})
    return out


def _row(t: np.ndarray, flat: int) -> int | None:
    if t.ndim < 2:
        return None
    return flat // max(1, t[0].size)


def _all_ignored(path: str, t: np.ndarray) -> list[dict[str, Any]]:
    if t.ndim < 2:
        return []
    ignored = (_rows(t).astype(np.int64) == IGNORE_INDEX).all(axis=1)
    return [{"leaf": path, "row": r, "check": "all_ignored",
             "message": f"{path} row {r}: every label is the ignore index {IGNORE_INDEX} (its loss is 0/0 = NaN "
                        "under a mean over the row)"}
            for r in np.flatnonzero(ignored).tolist()]


def _empty_masks(path: str, t: np.ndarray, padding: bool = False) -> list[dict[str, Any]]:
    """Rows that keep no position: all 0, or for a padding mask (true = leave out) all true."""
    if t.ndim < 2:
        return []
    if padding:
        empty = (_rows(t) != 0).all(axis=1)
        what = "every position is marked as padding"
    else:
        empty = ~(_rows(t) != 0).any(axis=1)
        what = "the mask is all 0"
    return [{"leaf": path, "row": r, "check": "empty_mask",
             "message": f"{path} row {r}: {what} (a softmax, or a mean, over no position is NaN)"}
            for r in np.flatnonzero(empty).tolist()]


def summary(found: list[dict[str, Any]], limit: int = MAX_FINDINGS) -> list[str]:
    """The findings as lines, at most ``limit`` of them plus a count of the rest."""
    lines = [f["message"] for f in found[:limit]]
    if len(found) > limit:
        lines.append(f"... and {len(found) - limit} more")
    return lines


def failure_note(batch: Any, tables: Mapping[str, Any] | None) -> str | None:
    """One note for the failure message (recorder side); None when the batch shows nothing. Never raises."""
    try:
        lines = summary(findings(batch, tables), limit=5)
    except Exception:  # the recorder must never raise its own errors into the training loop
        return None
    if not lines:
        return None
    return "reprokit: the failing step's batch: " + "; ".join(lines)
