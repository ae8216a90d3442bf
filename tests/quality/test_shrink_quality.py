"""The shrinker reaches minimal results within its replay budget (all CPU, real training loops)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rk_testing import PROJECTS, bundle_of, record, tree_digest

import reprokit
from reprokit.bundle import open_bundle
from reprokit.shrink import shrink


def test_one_poisoned_row_among_512_in_at_most_22_replays(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"batch_size": 512, "optimizer": "sgd"}
    _, exc = record(mlp, cfg, mlp.batches(cfg, 6, poison_step=4), tmp_path / "r", snapshot_every=100)
    r = shrink(exc.bundle, tmp_path / "small", passes=["rows"])
    assert r.after["rows"] == 1 and r.kept_rows == [3], "the batches helper poisons row 3"
    assert r.dataset_indices == [4 * 512 + 3]
    assert r.replays <= 22, r.replays  # 2*ceil(log2 512) + 4, counting the initial check


def test_two_rows_that_fail_only_together_are_both_kept(projects, tmp_path):
    pair = projects("rk_pair")
    _, exc = record(pair, {}, pair.batches(64, 5, 3, rows=(11, 50)), tmp_path / "r")
    r = shrink(exc.bundle, tmp_path / "small", passes=["steps", "rows"])
    assert r.kept_rows == [11, 50] and r.after["rows"] == 2 and r.after["steps"] == 1
    assert r.dataset_indices == [3 * 64 + 11, 3 * 64 + 50]


@pytest.mark.slow
def test_one_bad_token_in_256_positions(projects, tmp_path):
    lm = projects("rk_lm")
    cfg = {"vocab": 40, "max_len": 256, "nan_token": 13}
    p = 173
    _, exc = record(lm, cfg, lm.batches(cfg, 6, seq=256, bs=4, bad=(4, 2, p)), tmp_path / "r", snapshot_every=3)
    assert exc.failure.kind == "nonfinite_loss"
    r = shrink(exc.bundle, tmp_path / "small")
    lo, hi = r.seq_window
    assert lo <= p < hi and hi - lo <= 4, r.seq_window
    assert r.after == {"steps": 1, "rows": 1, "seq": hi - lo, "tokens": 1}
    assert r.kept_rows == [2]
    batch = open_bundle(r.output).step(4)[0]
    nonzero = torch.nonzero(batch["input_ids"]).tolist()
    assert nonzero == [[0, p - lo]] and batch["input_ids"][0, p - lo] == 13
    assert not batch["labels"].any(), "labels were neutralised too"


@pytest.mark.parametrize("min_len", [0, 14])
@pytest.mark.slow
def test_sequence_past_the_position_table_shrinks_to_table_size_plus_one(projects, tmp_path, min_len):
    lm = projects("rk_lm")
    P = 16
    cfg = {"vocab": 30, "max_len": P, "pos_table": True, "min_len": min_len}
    _, exc = record(lm, cfg, lm.batches(cfg, 10, seq=14, long_step=7, long_len=60), tmp_path / "r", snapshot_every=5)
    assert isinstance(exc, IndexError)
    r = shrink(bundle_of(exc), tmp_path / "small")
    assert r.after["seq"] == P + 1 and r.after["rows"] == 1 and r.after["steps"] == 1
    assert r.failure.exc_type == "IndexError"
    if min_len:
        # The binary search probes windows shorter than min_len: they raise ValueError, never accepted.
        assert r.different_failures > 0
    assert reprokit.replay(r.output).reproduced


@pytest.mark.slow
def test_candidates_failing_differently_are_never_accepted(projects, tmp_path):
    lm = projects("rk_lm")
    cfg = {"vocab": 40, "max_len": 64, "nan_token": 13, "min_len": 6}
    _, exc = record(lm, cfg, lm.batches(cfg, 3, seq=64, bs=4, bad=(2, 1, 30)), tmp_path / "r")
    r = shrink(exc.bundle, tmp_path / "small")
    assert r.different_failures > 0
    assert r.after["seq"] == 6, "the shortest window that still reaches the NaN without the ValueError"
    report = reprokit.replay(r.output)
    assert report.reproduced and report.runs[0].failure.kind == "nonfinite_loss"


@pytest.fixture(scope="module")
def empty_document_bundle(tmp_path_factory) -> Iterator[Path]:
    """rk_lm_mask, 4 steps, row 5 of step 3 an empty document: recorded once for the pass orders below, which
    only read it (checked at the end)."""
    sys.path.insert(0, str(PROJECTS))
    try:
        lm = importlib.import_module("rk_lm_mask")
    finally:
        sys.path.remove(str(PROJECTS))
    cfg = {"vocab": 30}
    _, exc = record(lm, cfg, lm.batches(cfg, 4, empty=(3, 5)), tmp_path_factory.mktemp("empty_doc") / "r")
    bundle = bundle_of(exc)
    before = tree_digest(bundle)
    yield bundle
    assert tree_digest(bundle) == before, "a shrink changed the bundle it shrank"


@pytest.mark.parametrize("passes", [None, "sequence,rows,tokens"])
@pytest.mark.slow
def test_an_empty_document_shrinks_to_that_document_not_to_a_cut_that_empties_every_one(empty_document_bundle,
                                                                                          tmp_path, passes):
    """Loss = mean over documents of (ce * mask).sum / mask.sum; row 5 of step 3 has no target (0/0).

    A 1-position window also fails with a NaN loss (no document has a target there), and
    after it any row would do: the origin check (same op, same line, no healthy row NaN
    there, tried with a control row once the culprit is alone) rejects it, in any pass order.
    """
    r = shrink(empty_document_bundle, tmp_path / "small", **({"passes": passes.split(",")} if passes else {}))
    assert r.kept_rows == [5] and r.dataset_indices == [3 * 8 + 5]
    lo, hi = r.seq_window
    assert r.after["rows"] == 1 and r.after["seq"] == hi - lo >= 2
    small = open_bundle(r.output)
    mask = small.step(3)[0]["loss_mask"]
    assert mask.shape == (1, hi - lo) and not mask.any(), "still the empty document"
    # ...and no longer a window where any document is empty: the first healthy row keeps a target in it.
    assert open_bundle(empty_document_bundle).step(3)[0]["loss_mask"][0, lo + 1:hi].any()
    assert r.replays <= 30, r.replays
    assert r.origin is not None and r.origin.rows == (5,) and r.origin_changed > 0
    assert small.run["provenance"]["origin"]["rows"] == [5] and small.run["provenance"]["origin_checks"] > 0
    assert reprokit.replay(r.output).reproduced


def test_bundle_that_does_not_reproduce_is_refused(shared_nan_bundle, tmp_path):
    """rk_mlp with a NaN input at step 6 (the shared NaN bundle, only read), replayed with code that sanitises it."""
    import shutil

    fixed = tmp_path / "fixed"
    shutil.copytree(shared_nan_bundle / "code", fixed)
    src = (fixed / "rk_mlp.py").read_text().replace("def train_step(state, batch):\n",
                                                    "def train_step(state, batch):\n"
                                                    "    batch = {**batch, 'x': torch.nan_to_num(batch['x'])}\n")
    (fixed / "rk_mlp.py").write_text(src)
    with pytest.raises(reprokit.DidNotReproduce, match="does not reproduce"):
        shrink(shared_nan_bundle, tmp_path / "small", code=fixed)
    assert not (tmp_path / "small").exists()


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(2, 40), bad_row=st.integers(0, 39), steps=st.integers(1, 6), every=st.integers(1, 4))
@pytest.mark.slow
def test_shrinking_never_grows_and_always_replays(projects, tmp_path_factory, rows, bad_row, steps, every):
    mlp = projects("rk_mlp")
    tmp = tmp_path_factory.mktemp("prop")
    cfg = {"batch_size": rows, "optimizer": "adam"}

    def batches():
        for i, b in enumerate(mlp.batches(cfg, steps + 1)):
            if i == steps:
                b["x"][bad_row % rows, 2] = float("inf")
            yield b

    _, exc = record(mlp, cfg, batches(), tmp / "r", snapshot_every=every)
    r = shrink(exc.bundle, tmp / "small", budget=60)
    for k in ("steps", "rows", "seq", "tokens"):
        assert (r.after[k] or 0) <= (r.before[k] or 0), (k, r.before, r.after)
    assert reprokit.replay(r.output).reproduced
    assert open_bundle(r.output).run["provenance"]["source_manifest_sha256"]


@pytest.mark.slow
def test_a_candidate_raising_the_same_type_in_the_same_frame_with_another_message_is_another_failure(projects,
                                                                                                     tmp_path):
    """``check`` raises ValueError for a value beyond 1e3 (the recorded bug, row 5) and, in the same line's function,
    for a batch under 4 rows. Cutting rows to 1 raises the second: same type, same frame, another bug. The shrink
    keeps the recorded one: 4 rows, row 5 among them."""
    two = projects("rk_two_raises")
    _, exc = record(two, {}, two.batches(32, 4, 2, row=5), tmp_path / "r")
    assert isinstance(exc, ValueError) and "beyond 1e3" in str(exc)
    r = shrink(bundle_of(exc), tmp_path / "small", passes=["steps", "rows"])
    assert r.failure.message == "a value beyond 1e3 in the batch", r.failure.message
    assert r.after["rows"] == 4 and 5 in r.kept_rows and r.after["steps"] == 1, (r.after, r.kept_rows)
    assert r.different_failures > 0
    report = reprokit.replay(r.output)
    assert report.reproduced and report.runs[0].failure.message == "a value beyond 1e3 in the batch"


@pytest.mark.slow
def test_a_4d_attention_mask_is_cut_with_the_sequence(projects, tmp_path):
    """The sequence pass cut ``[n, S]`` tensors only: a ``[n, 1, S, S]`` attention mask kept its S, every shorter
    window failed with a shape error (another failure), and the sequence stayed 48 long. The mask's two position
    dimensions are now cut with the tokens (its sub-mask over the kept positions)."""
    lm = projects("rk_lm_attn4d")
    cfg = {"vocab": 30, "nan_token": 13}
    _, exc = record(lm, cfg, lm.batches(cfg, 3, bad=(2, 1, 30)), tmp_path / "r")
    assert exc.failure.kind == "nonfinite_loss"
    r = shrink(exc.bundle, tmp_path / "small", passes=["steps", "rows", "sequence"])
    assert r.before["seq"] == 48 and r.after["rows"] == 1 and r.after["seq"] <= 2, (r.after, r.seq_window)
    lo, hi = r.seq_window
    assert lo <= 30 < hi, r.seq_window
    batch = open_bundle(r.output).step(2)[0]
    assert batch["attention_mask"].shape == (1, 1, hi - lo, hi - lo)
    assert torch.equal(batch["attention_mask"][0, 0], torch.ones(hi - lo, hi - lo, dtype=torch.bool).tril())
    assert reprokit.replay(r.output).reproduced
