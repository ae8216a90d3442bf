"""The batch diagnosis (`inspect`, `inspect --batch`, the failure note) for each classic data fault of FAILURES.md."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from rk_testing import bundle_of, record

from reprokit.bundle import open_bundle
from reprokit.cli import main
from reprokit.diagnose import findings, model_tables


def _inspect(bundle, *extra):
    r = CliRunner().invoke(main, ["inspect", str(bundle), *extra])
    assert r.exit_code == 0, r.output
    return r.output


def _diag(bundle):
    return json.loads(_inspect(bundle, "--json"))["diagnosis"]


def _checks(diag):
    return [(f["check"], f["leaf"], f["row"]) for f in diag["findings"]]


def test_token_id_past_the_vocab(projects, tmp_path):
    lm = projects("rk_lm")
    cfg = {"vocab": 64, "max_len": 32}
    _, exc = record(lm, cfg, lm.batches(cfg, 6, oov_step=4), tmp_path, snapshot_every=3)
    assert isinstance(exc, IndexError)
    note = [n for n in exc.__notes__ if "batch" in n]
    assert note and "input_ids row 5 position 7 = 67 >= num_embeddings 64 of tok" in note[0], exc.__notes__
    bundle = bundle_of(exc)
    d = _diag(bundle)
    assert d["step"] == 4 and ("id_range", "input_ids", 5) in _checks(d)
    assert d["tables"]["embeddings"] == [{"name": "tok", "num_embeddings": 64, "padding_idx": None}]
    assert d["tables"]["positions"] == [{"name": "pos", "num_embeddings": 32, "padding_idx": None}]
    # index (dataset indices, up to 39 here) is no id; labels are clamped below the vocab: nothing else is found
    assert _checks(d) == [("id_range", "input_ids", 5)]
    text = _inspect(bundle)
    assert "input_ids row 5 position 7 = 67 >= num_embeddings 64 of tok" in text
    shown = _inspect(bundle, "--batch", "--rows", "5")
    ids_block = shown.split("input_ids  int64[8, 12]\n", 1)[1]
    assert ids_block.startswith("  row 5: [37, 28, 57, 32, 16, 19, 41, 67, 51,"), ids_block
    assert "row 4:" not in shown


def test_a_long_sample_past_the_position_table(projects, tmp_path):
    lm = projects("rk_lm")
    cfg = {"vocab": 64, "max_len": 16, "pos_table": True}
    _, exc = record(lm, cfg, lm.batches(cfg, 5, long_step=3), tmp_path, snapshot_every=2)
    d = _diag(bundle_of(exc))
    assert ("sequence_length", "input_ids", None) in _checks(d)
    msg = next(f["message"] for f in d["findings"] if f["check"] == "sequence_length")
    assert msg.startswith("input_ids: sequence length 20 > 16 positions of pos_table"), msg


def test_nan_in_the_inputs_per_row(projects, tmp_path):
    mlp = projects("rk_mlp")
    _, exc = record(mlp, {}, mlp.batches({}, 6, poison_step=4), tmp_path, snapshot_every=3)
    d = _diag(bundle_of(exc))
    assert _checks(d) == [("nonfinite", "x", 3)]
    assert d["findings"][0]["message"] == "x row 3: 1 NaN and 0 inf value(s), first at position 1"
    assert d["tables"] == {"embeddings": [], "positions": []}
    assert any("x row 3: 1 NaN" in n for n in exc.__notes__)


def test_a_document_with_an_empty_loss_mask(projects, tmp_path):
    lm = projects("rk_lm_mask")
    cfg = {"vocab": 50}
    _, exc = record(lm, cfg, lm.batches(cfg, 5, empty=(3, 2)), tmp_path, snapshot_every=2)
    d = _diag(bundle_of(exc))
    assert _checks(d) == [("empty_mask", "loss_mask", 2)]


def test_labels_all_ignored(projects, tmp_path):
    lm = projects("rk_lm")
    cfg = {"vocab": 64, "max_len": 32}

    def batches():
        yield from lm.batches(cfg, 4, bs=2)
        bad = next(lm.batches(cfg, 1, bs=2))
        bad["labels"][:] = -100  # every label ignored: the mean over no target is 0/0
        yield bad

    _, exc = record(lm, cfg, batches(), tmp_path, snapshot_every=2)
    d = _diag(bundle_of(exc))
    assert _checks(d) == [("all_ignored", "labels", 0), ("all_ignored", "labels", 1)]


def test_a_clean_batch_says_so(projects, tmp_path):
    mlp = projects("rk_mlp")
    _, exc = record(mlp, {}, mlp.batches({}, 6, zero_step=4), tmp_path, step=mlp.sqrt_step, snapshot_every=3)
    text = _inspect(bundle_of(exc))
    assert "shows no data fault" in text


def test_findings_on_hand_made_batches():
    tables = model_tables(torch.nn.ModuleDict({"wte": torch.nn.Embedding(10, 2), "wpe": torch.nn.Embedding(4, 2)}))
    assert tables["positions"] == [{"name": "wpe", "num_embeddings": 4, "padding_idx": None}]
    got = findings({"input_ids": torch.tensor([[1, 2, -3, 4, 5]]), "attention_mask": torch.tensor([[1, 1, 1, 1, 1]])},
                   tables)
    assert [f["check"] for f in got] == ["negative_id", "sequence_length"]
    assert findings({"ids": torch.tensor([[1, 2]])}, None) == []


@pytest.mark.parametrize("rows", ["x", "3-", "-1", "3-1", "0-3000000"])
def test_bad_rows_are_a_usage_error(projects, tmp_path, rows):
    mlp = projects("rk_mlp")
    _, exc = record(mlp, {}, mlp.batches({}, 3, poison_step=1), tmp_path, snapshot_every=3)
    r = CliRunner().invoke(main, ["inspect", str(bundle_of(exc)), "--batch", "--rows", rows])
    assert r.exit_code == 2 and "--rows" in r.output, r.output


def test_rows_past_the_batch_are_named_as_spans(projects, tmp_path):
    mlp = projects("rk_mlp")
    _, exc = record(mlp, {}, mlp.batches({}, 3, poison_step=1), tmp_path, snapshot_every=3)
    r = CliRunner().invoke(main, ["inspect", str(bundle_of(exc)), "--batch", "--rows", "2,60-90000,95000"])
    assert r.exit_code == 0, r.output
    n = open_bundle(bundle_of(exc)).step(1)[0]["x"].shape[0]
    assert f"(no row 60-90000, 95000: the leaf has {n} rows)" in r.output, r.output
    assert len(r.output) < 5000


# --- inspect --plot -----------------------------------------------------------------------

@pytest.mark.slow
def test_plot_has_lr_and_loss_scale_panels_and_plain_narrow_axes(projects, tmp_path):
    from reprokit.bundle import open_bundle
    from reprokit.report import log_axis, plot_panels, plot_title

    mlp = projects("rk_mlp")
    cfg = {"scaler": True, "scheduler": "lambda", "steps": 12}
    batches = [dict(b, grad_mult=1.0) for b in mlp.batches(cfg, 8, poison_step=6)]
    _, exc = record(mlp, cfg, batches, tmp_path, snapshot_every=4)
    bundle = open_bundle(bundle_of(exc))
    hist = bundle.run["history"]
    assert all(isinstance(h["lr"], float) for h in hist) and len({h["lr"] for h in hist}) > 1, hist
    assert all(h["loss_scale"] == 256.0 for h in hist[:-1]), hist
    assert [k for k, _ in plot_panels(hist)] == ["loss", "grad_norm", "lr", "loss_scale"]
    assert [k for k, _ in plot_panels([{"loss": 1.0, "grad_norm": 2.0}])] == ["loss", "grad_norm"]
    assert not log_axis([7.78, 7.9, None]) and log_axis([0.01, 5.0]) and not log_axis([-1.0, 50.0])
    out = tmp_path / "plot.png"
    r = CliRunner().invoke(main, ["inspect", str(bundle.path), "--plot", str(out)])
    assert r.exit_code == 0 and out.read_bytes()[:4] == b"\x89PNG"
    assert plot_title(bundle).startswith("non-finite")
