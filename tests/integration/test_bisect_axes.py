"""`reprokit bisect steps | layers | precision` and `inspect --plot` with real tiny models."""

from __future__ import annotations

import json
import sys

import pytest
from click.testing import CliRunner
from rk_testing import bundle_of, record

from reprokit.bisect import bisect_layers, bisect_precision, bisect_steps
from reprokit.bundle import open_bundle
from reprokit.cli import main


@pytest.mark.slow
def test_fp16_overflow_fails_in_fp16_passes_in_fp32_and_bf16(projects, tmp_path):
    num = projects("rk_numerics")
    cfg = {"amp": True}
    _, exc = record(num, cfg, num.batches(10, scale_from=6, scale=1e5), tmp_path, snapshot_every=4)
    assert exc.failure.kind == "nonfinite_loss" and exc.failure.step == 6
    d = bisect_precision(open_bundle(exc.bundle))
    v = d["variants"]
    assert v["recorded"] == "fail" and v["fp16"] == "fail"
    assert v["fp32"] == "pass" and v["bf16"] == "pass"
    assert v["tf32_on"] == v["tf32_off"] == "n/a", "no TF32 on CPU: listed, not dropped"
    assert set(v) == {"recorded", "fp32", "bf16", "fp16", "tf32_on", "tf32_off", "sdpa_math", "sdpa_flash",
                      "sdpa_efficient", "sdpa_cudnn", "deterministic"}
    assert d["smallest_fix"] == "bf16"
    cli = CliRunner().invoke(main, ["bisect", "precision", str(exc.bundle), "--variants", "recorded,fp32", "--json"])
    assert cli.exit_code == 0, cli.output
    assert json.loads(cli.output)["variants"] == {"recorded": "fail", "fp32": "pass"}


@pytest.mark.slow
def test_unstable_softmax_is_named_with_its_op(projects, tmp_path):
    num = projects("rk_numerics")
    cfg = {"softmax": True}
    _, exc = record(num, cfg, num.batches(8, scale_from=5, scale=400.0), tmp_path, snapshot_every=4)
    assert exc.failure.kind == "nonfinite_loss"
    d = bisect_layers(open_bundle(exc.bundle))
    f = d["first_nonfinite"]
    assert (f["module"], f["class"], f["phase"], f["op"]) == ("attn", "NaiveSoftmax", "forward", "exp")
    assert f["inputs_already_nonfinite"] is False
    assert d["frames"][-1]["module"] == "attn" and d["frames"][-2]["module"] == "fc1"
    assert d["frames"][-2]["outputs"]["nonfinite"] == 0 and d["frames"][-2]["outputs"]["abs_max"] > 88
    cli = CliRunner().invoke(main, ["bisect", "layers", str(exc.bundle)])
    assert cli.exit_code == 0 and "first non-finite: attn (NaiveSoftmax), forward, op aten.exp" in cli.output


def test_exploding_lr_is_found_before_the_nan(projects, tmp_path):
    num = projects("rk_numerics")
    cfg = {"lr": 1e-3, "lr_growth": 1.6}
    _, exc = record(num, cfg, num.batches(60), tmp_path, snapshot_every=100)
    assert exc.failure.kind in ("nonfinite_loss", "nonfinite_grad")
    d = bisect_steps(open_bundle(exc.bundle))
    assert d["first_bad_step"] is not None and d["first_bad_step"] < exc.failure.step, d["reason"]
    assert "gradient norm exploded" in d["reason"] or "loss spike" in d["reason"]
    row = d["per_step"][d["first_bad_step"]]
    assert row["lr"][0] > 1e-3 and len(row["top_grads"]) == 4 and row["grad_norm"] > 0
    assert d["per_step"][-1]["step"] == exc.failure.step
    cli = CliRunner().invoke(main, ["bisect", "steps", str(exc.bundle), "--json"])
    out = json.loads(cli.output)
    assert {"first_bad_step", "reason", "per_step"} <= out.keys() and out["first_bad_step"] == d["first_bad_step"]


def test_exception_inside_a_submodule_is_named(projects, tmp_path):
    lm = projects("rk_lm")
    cfg = {"vocab": 30, "max_len": 16, "pos_table": True}
    _, exc = record(lm, cfg, lm.batches(cfg, 6, long_step=4, long_len=20), tmp_path, snapshot_every=3)
    d = bisect_layers(open_bundle(bundle_of(exc)))
    r = d["raised_in"]
    assert r["module"] == "pos_table" and r["class"] == "Embedding"
    assert r["received"] == ["0: int64[20]"] and r["exception"].startswith("IndexError")


@pytest.mark.slow
def test_an_id_outside_the_embedding_table_is_named_with_the_table_size(projects, tmp_path):
    """The raising embedding's out-of-range id, where it is and the table size (it said only `int64[8, 12]`),
    and no empty module table after it (no module finished before the first one raised)."""
    lm = projects("rk_lm")
    cfg = {"vocab": 30, "max_len": 16}
    _, exc = record(lm, cfg, lm.batches(cfg, 6, oov_step=4), tmp_path, snapshot_every=3)
    d = bisect_layers(open_bundle(bundle_of(exc)))
    assert d["raised_in"]["out_of_range"] == {"id": 33, "at": [5, 7], "count": 1, "num_embeddings": 30}
    cli = CliRunner().invoke(main, ["bisect", "layers", str(bundle_of(exc))])
    assert cli.exit_code == 0, cli.output
    assert cli.output.splitlines()[1:] == [
        "  it received: 0: int64[8, 12]",
        "  id 33 at [5, 7] is outside its table of 30 (num_embeddings; valid ids 0..29); 1 id out of range"]


@pytest.mark.slow
def test_inspect_plot(nan_bundle_factory, tmp_path):
    bundle = nan_bundle_factory()
    out = tmp_path / "plot.png"
    r = CliRunner().invoke(main, ["inspect", str(bundle), "--plot", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_inspect_plot_without_matplotlib_says_how_to_get_it(nan_bundle_factory, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    r = CliRunner().invoke(main, ["inspect", str(nan_bundle_factory()), "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 2 and "pip install matplotlib" in r.output


@pytest.fixture
def nan_bundle_factory(projects, tmp_path):
    def make():
        mlp = projects("rk_mlp")
        _, exc = record(mlp, {}, mlp.batches({}, 30, poison_step=25), tmp_path / "r", snapshot_every=10)
        return exc.bundle
    return make


@pytest.mark.slow
def test_bisect_layers_and_extract_on_a_model_that_returns_a_dict_print_no_torch_warning(projects, tmp_path):
    """Torch warns that a module returning a dict gets no backward hook; the suite turns warnings into errors."""
    from reprokit.extract import extract

    net = projects("rk_dict_out")
    _, exc = record(net, {}, net.batches(6), tmp_path / "r", snapshot_every=2)
    assert exc.failure.kind == "nonfinite_loss" and exc.failure.step == 4
    d = bisect_layers(open_bundle(exc.bundle))
    assert d["first_nonfinite"]["module"] == "fc1" and d["first_nonfinite"]["phase"] == "forward", d["first_nonfinite"]
    # The batch's inf reaches fc2, whose sum of +inf and -inf makes the NaN: fc2 did not make the non-finite value
    # from finite inputs, so there is no module-level repro (a warning would have been raised as an error first).
    from reprokit.errors import DidNotReproduce
    with pytest.raises(DidNotReproduce, match="fc2 .* received the non-finite value in its inputs"):
        extract(open_bundle(exc.bundle), tmp_path / "cut")
