"""The batch diagnosis does not blame a padding mask (true = leave out) or a special-tokens mask for nothing."""

from __future__ import annotations

import pytest
import torch

from reprokit.diagnose import findings


def _attention(key_padding_mask):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(4, 1, batch_first=True)
    x = torch.randn(2, 3, 4)
    return mha(x, x, x, key_padding_mask=key_padding_mask)[0]


def test_a_padding_mask_without_padding_is_no_finding_and_an_all_padding_row_is():
    no_padding = torch.zeros(2, 3, dtype=torch.bool)
    assert bool(torch.isfinite(_attention(no_padding)).all())  # the real convention: nothing left out, all fine
    assert findings({"src_key_padding_mask": no_padding}, None) == []  # before: both rows "all 0"

    all_padding = no_padding.clone()
    all_padding[1] = True
    assert not bool(torch.isfinite(_attention(all_padding)[1]).any())  # a row that leaves out everything is NaN
    got = findings({"src_key_padding_mask": all_padding}, None)
    assert [(f["check"], f["row"]) for f in got] == [("empty_mask", 1)]
    assert "every position is marked as padding" in got[0]["message"]


def test_a_row_without_special_tokens_is_no_finding_and_an_empty_attention_mask_still_is():
    assert findings({"special_tokens_mask": torch.tensor([[0, 0, 0], [1, 0, 1]])}, None) == []
    # "pad_mask" is written both ways (true = padding, or tokens != pad_id): no row of it is a sure finding
    assert findings({"pad_mask": torch.tensor([[True, True], [False, False]])}, None) == []
    got = findings({"attention_mask": torch.tensor([[1, 1, 0], [0, 0, 0]])}, None)
    assert [(f["check"], f["row"]) for f in got] == [("empty_mask", 1)]
    assert got[0]["message"].startswith("attention_mask row 1: the mask is all 0")


def test_lengths_and_per_sample_classes_are_not_held_against_the_token_table():
    tables = {"embeddings": [{"name": "chars", "num_embeddings": 30, "padding_idx": 0}], "positions": []}
    batch = {"char_ids": torch.tensor([[3, 4, 0], [5, 0, 0]]), "lengths": torch.tensor([300, 120]),
             "num_words": torch.tensor([40, 41]), "labels": torch.tensor([57, 2]),
             "images": torch.full((2, 3, 4, 4), 200, dtype=torch.uint8)}
    # Before: "lengths position 0 = 300 >= num_embeddings 30 of chars", the same for num_words, labels and the
    # images' pixel levels.
    assert findings(batch, tables) == []
    got = findings({**batch, "char_ids": torch.tensor([[3, 31, 0], [5, 0, 0]])}, tables)
    assert [(f["check"], f["leaf"], f["row"]) for f in got] == [("id_range", "char_ids", 0)]
    lm = findings({"labels": torch.tensor([[1, 2, 99]])}, tables)  # token labels index the vocabulary: checked
    assert [(f["check"], f["leaf"]) for f in lm] == [("id_range", "labels")]


def test_a_negative_label_is_said_as_cross_entropy_sees_it():
    labels = torch.tensor([2, -1])
    with pytest.raises(IndexError):  # what the message claims, checked on the op itself
        torch.nn.functional.cross_entropy(torch.zeros(2, 3), labels)
    got = findings({"labels": labels}, {"embeddings": [{"name": "wte", "num_embeddings": 2}], "positions": []})
    assert [(f["check"], f["leaf"]) for f in got] == [("negative_id", "labels")], got
    assert "cross_entropy raises unless it is its ignore_index" in got[0]["message"], got[0]["message"]
    assert "embedding" not in got[0]["message"]  # before: "an embedding lookup raises IndexError"
