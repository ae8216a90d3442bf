"""Rows of batches that are not one tensor per field: lists of per-sample images or target
dicts, as detection collates make, must be cut as rows, and must not make a channel dim look like the batch."""

from __future__ import annotations

import importlib
import sys

import torch
from rk_testing import bundle_of, record

import reprokit
from reprokit.bundle import open_bundle
from reprokit.shrink import shrink
from reprokit.shrink.batch import batch_size, concat_rows, select_rows

PROJECT = '''\
import torch
from torch import nn

import reprokit


def build(config):
    torch.manual_seed(0)
    m = nn.Linear(6, 1)
    return reprokit.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=1e-2))


def train_step(state, batch):
    feats = torch.stack([img.mean(0) for img in batch["images"]])  # one [C, W] image per sample
    loss = nn.functional.mse_loss(state.model(feats).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss
'''


def _batches(steps=6, n=8, bad=(4, 5)):
    g = torch.Generator().manual_seed(0)
    for k in range(steps):
        images = [torch.randn(3, 6, generator=g) for _ in range(n)]
        if k == bad[0]:
            images[bad[1]][1, 2] = float("nan")
        yield {"images": images, "y": torch.randn(n, generator=g), "index": torch.arange(k * n, (k + 1) * n),
               "names": [f"img{k}-{i}" for i in range(n)]}


def test_a_list_of_per_sample_images_is_cut_as_rows_and_the_right_sample_is_named(tmp_path, monkeypatch):
    """Eight 3-channel images: the rows are the 8 images, not the 3 channels (cutting those kept every image,
    the poisoned one too, and named dataset index 33 for the sample at 37)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "rk_shrink_images.py").write_text(PROJECT)
    monkeypatch.syspath_prepend(str(proj))
    monkeypatch.delitem(sys.modules, "rk_shrink_images", raising=False)
    mod = importlib.import_module("rk_shrink_images")
    _, exc = record(mod, {}, _batches(), tmp_path / "r", snapshot_every=2)
    monkeypatch.delitem(sys.modules, "rk_shrink_images", raising=False)
    r = shrink(bundle_of(exc), tmp_path / "small", passes=["steps", "rows"])
    assert (r.before["rows"], r.after["rows"]) == (8, 1)
    assert r.kept_rows == [5] and r.dataset_indices == [37], (r.kept_rows, r.dataset_indices)
    batch = open_bundle(r.output).step(4)[0]
    assert [tuple(t.shape) for t in batch["images"]] == [(3, 6)] and batch["names"] == ["img4-5"]
    assert torch.isnan(batch["images"][0][1, 2]) and batch["y"].shape == (1,)
    assert reprokit.replay(r.output).reproduced


def test_batch_size_of_structured_batches():
    imgs = [torch.zeros(3, 6) for _ in range(8)]
    assert batch_size({"images": imgs}) == 8
    assert batch_size({"images": imgs, "y": torch.zeros(8)}) == 8
    targets = [{"boxes": torch.zeros(k + 1, 4), "labels": torch.zeros(k + 1, dtype=torch.long)} for k in range(4)]
    assert batch_size((torch.zeros(4, 3, 8, 8), targets)) == 4
    # Batched tensors in a tuple stay batched tensors: (x, y) of 2 rows is not 2 samples of one tensor each.
    assert batch_size((torch.zeros(2, 5), torch.zeros(2))) == 2
    assert batch_size([torch.zeros(16, 4), torch.zeros(16)]) == 16
    # ... and of one row: the (x, y) a shrink leaves is one row, not two samples of one row each.
    assert batch_size([torch.zeros(1, 4), torch.zeros(1)]) == 1
    assert batch_size((torch.zeros(1, 9, dtype=torch.long), torch.zeros(1, 9, dtype=torch.long))) == 1
    assert batch_size({"input_ids": torch.zeros(4, 9, dtype=torch.long), "mask": torch.ones(4, 9)}) == 4


def test_select_and_concat_rows_of_per_sample_lists():
    targets = [{"boxes": torch.full((k + 1, 4), float(k))} for k in range(4)]
    batch = (torch.arange(4.0)[:, None].expand(4, 3), targets, ["a", "b", "c", "d"])
    x, t, names = select_rows(batch, 4, [2])
    assert x.tolist() == [[2.0] * 3] and len(t) == 1 and t[0]["boxes"].shape == (3, 4) and names == ["c"]
    merged = concat_rows((x, t, names), 1, select_rows(batch, 4, [0]))
    assert merged is not None and merged[0][:, 0].tolist() == [2.0, 0.0]
    assert [b["boxes"].shape[0] for b in merged[1]] == [3, 1] and merged[2] == ["c", "a"]
    # Two batched tensors in a tuple of length n are cut inside, not picked between.
    a, b = select_rows((torch.arange(2.0), torch.arange(2.0) + 10), 2, [1])
    assert a.tolist() == [1.0] and b.tolist() == [11.0]


def test_a_2d_leaf_named_like_an_index_is_no_micro_batch_layout_without_a_stacked_sibling():
    """nanoGPT names its token ids ``idx``: ``{"idx": [B, T], "targets": [B, T]}`` is an ordinary batch of B rows (read as
    B micro-batches of T rows, shrink cut token positions as rows and named token ids as dataset indices)."""
    import torch

    from reprokit.shrink import micro
    from reprokit.shrink.case import rows_and_seq

    ids = torch.arange(32).reshape(4, 8)
    plain = {"idx": ids, "targets": ids.clone()}
    assert micro.layout(plain) is None and rows_and_seq(plain) == (4, 8)
    stacked = {"index": torch.arange(8).reshape(2, 4), "x": torch.zeros(2, 4, 8, dtype=torch.long)}
    lay = micro.layout(stacked)
    assert lay is not None and lay.kind == "stacked" and lay.paths == {"index", "x"}


def test_token_ids_named_idx_are_data_and_the_index_leaf_beside_them_names_the_samples():
    """A GPT batch ``{"idx": [B, T], "targets": [B, T], "index": [B]}``: the dataset indices are ``index``'s values,
    never a row of token ids, and the token pass may neutralise ids in ``idx`` (it kept them all before)."""
    import torch

    from reprokit.shrink.batch import dataset_indices, index_paths, neutralise, token_positions

    ids = torch.arange(1, 33).reshape(4, 8)
    batch = {"idx": ids, "targets": ids.clone(), "index": torch.tensor([40, 41, 42, 43])}
    assert index_paths(batch) == {"index"}
    assert dataset_indices(batch, (1, 3)) == [41, 43]
    assert {p for p, _ in token_positions(batch, pad_id=0)} == {"idx", "targets"}
    cut = neutralise(batch, {("idx", 0)}, pad_id=0)
    assert cut["idx"].reshape(-1).tolist() == [1] + [0] * 31 and cut["index"].tolist() == [40, 41, 42, 43]
    # a 1-D integer leaf named idx is an index (rk_pair's batches); a float one named index is data
    assert index_paths({"x": torch.zeros(4, 2), "idx": torch.arange(4)}) == {"idx"}
    assert index_paths({"x": torch.zeros(4, 2), "index": torch.zeros(4)}) == frozenset()
