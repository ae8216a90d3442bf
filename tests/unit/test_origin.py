"""The origin watcher and the sequence-dimension rules, on plain tensors (no bundle)."""

from __future__ import annotations

import torch

from reprokit.origin import Origin, OriginWatcher, same_origin
from reprokit.shrink.batch import concat_rows, select_seq, seq_len


def _line(marker: str) -> str:
    import inspect

    lines = inspect.getsource(inspect.getmodule(_line)).splitlines()  # type: ignore[arg-type]
    return f"test_origin.py:{next(i for i, text in enumerate(lines, 1) if f'# {marker}' in text)}"


def test_the_minus_inf_of_an_attention_mask_is_no_origin_but_the_fully_masked_row_is():
    scores = torch.randn(3, 4)
    masked = torch.tensor([[False, True, True, True], [True, True, True, True], [False, False, True, True]])
    with OriginWatcher(rows=3) as w:
        p = scores.masked_fill(masked, float("-inf")).softmax(-1)  # ROW 1 IS FULLY MASKED
        p.sum()
    o = w.origin
    assert o is not None and o.created and o.value == "nan" and o.phase == "forward" and o.module is None
    assert o.op == "aten._softmax.default" and o.rows == (1,)
    assert o.site == _line("ROW 1 IS FULLY MASKED")


def test_zero_over_zero_is_made_where_nothing_was_nonfinite_before():
    m = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    ce = torch.rand(3, 2) + 0.1
    with OriginWatcher(rows=3) as w:
        per_doc = (ce * m).sum(1) / m.sum(1)  # EMPTY DOC
        (per_doc * 0).sum()  # propagates the NaN: not a second origin
    assert (w.origin.op, w.origin.value, w.origin.rows) == ("aten.div.Tensor", "nan", (1,))
    assert w.origin.site == _line("EMPTY DOC")


def test_a_nan_carried_in_is_first_seen_where_no_op_makes_one():
    x = torch.tensor([[1.0, float("nan")], [2.0, 3.0]])
    with OriginWatcher(rows=2) as w:
        (x * 2).exp()
    assert w.created is None and w.origin is not None
    assert (w.origin.op, w.origin.created, w.origin.rows) == ("aten.mul.Tensor", False, (0,))


def test_an_in_place_op_that_makes_inf_is_seen_as_making_it():
    x = torch.tensor([1.0, 0.0])
    with OriginWatcher() as w:
        x.reciprocal_()
    assert w.origin is not None and w.origin.created and w.origin.value == "inf"


def test_same_origin_allows_fewer_bad_rows_but_no_new_ones():
    ref = Origin("forward", "aten.div.Tensor", "nan", True, None, "lm.py:31", None, (5, 6))
    at = lambda rows: Origin("forward", "aten.div.Tensor", "nan", True, None, "lm.py:31", None, rows)  # noqa: E731
    assert same_origin(ref, at((0,)), [5])
    assert same_origin(ref, at((0, 1)), [6, 5])
    assert not same_origin(ref, at((0, 1)), [5, 2]), "original row 2 was finite there"
    assert not same_origin(ref, Origin("forward", "aten.div.Tensor", "nan", True, None, "lm.py:40", None, (0,)),
                           [5]), "another line"
    assert not same_origin(ref, None, [5])
    assert Origin.from_json(ref.to_json()) == ref


def test_the_sequence_is_the_length_of_integer_token_tensors_only():
    n = 4
    dense = {"x": torch.randn(n, 64), "y": torch.randn(n)}
    assert seq_len(dense, n) is None, "a dense feature dim is no sequence"
    assert seq_len({"img": torch.zeros(n, 3, 8, 8, dtype=torch.uint8)}, n) is None
    batch = {"input_ids": torch.ones(n, 12, dtype=torch.long), "mask": torch.ones(n, 12, dtype=torch.long),
             "feat": torch.randn(n, 12, 3), "dense": torch.randn(n, 64), "index": torch.arange(n)}
    assert seq_len(batch, n) == 12
    cut = select_seq(batch, n, 12, 2, 5)
    assert [tuple(cut[k].shape) for k in ("input_ids", "mask", "feat", "dense", "index")] == \
        [(n, 3), (n, 3), (n, 3, 3), (n, 64), (n,)]


def test_concat_rows_appends_one_row_or_says_it_cannot():
    a = {"ids": torch.zeros(2, 3, dtype=torch.long), "index": torch.arange(2), "src": ["a", "b"], "k": 7}
    b = {"ids": torch.ones(1, 3, dtype=torch.long), "index": torch.tensor([9]), "src": ["z"], "k": 7}
    c = concat_rows(a, 2, b)
    assert c["ids"].tolist() == [[0, 0, 0], [0, 0, 0], [1, 1, 1]] and c["index"].tolist() == [0, 1, 9]
    assert c["src"] == ["a", "b", "z"] and c["k"] == 7
    assert concat_rows(a, 2, {**b, "ids": torch.ones(1, 4, dtype=torch.long)}) is None


def test_the_sequence_cut_takes_both_position_dimensions_of_a_pairwise_mask_only():
    """A 4-D mask (any dtype) and a boolean or integer ``[n, S, S]`` are position-by-position: both dimensions are
    cut. A floating ``[n, S, S]`` may be features that happen to be S wide: dim 1 only, as any ``[n, S, ...]``."""
    batch = {"ids": torch.arange(16).reshape(2, 8), "mask4": torch.ones(2, 1, 8, 8).tril(),
             "mask3": torch.ones(2, 8, 8, dtype=torch.bool), "feats": torch.ones(2, 8, 8), "other": torch.ones(3, 8),
             "pad": torch.ones(2, 1, 1, 8)}
    out = select_seq(batch, 2, 8, 2, 5)
    assert {k: tuple(v.shape) for k, v in out.items()} == {"ids": (2, 3), "mask4": (2, 1, 3, 3), "mask3": (2, 3, 3),
                                                           "feats": (2, 3, 8), "other": (3, 8), "pad": (2, 1, 1, 3)}
    assert torch.equal(out["mask4"], batch["mask4"][:, :, 2:5, 2:5]) and torch.equal(out["ids"], batch["ids"][:, 2:5])
