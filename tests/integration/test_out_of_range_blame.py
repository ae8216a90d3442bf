"""`bisect layers` and `extract` on an LR divergence: the op that made the NaN is not blamed as its cause.

The nanoGPT-style loop of rk_gpt at an LR of 1e5: the first update multiplies every weight by orders of magnitude,
the residual stream grows step after step, and some op (a LayerNorm, whose variance squares ~1e19..1e20 inputs)
overflows float32 steps later. Which op and which step may vary across CPUs; that its inputs were already out of
range (many orders of magnitude past the first step's) and that the weights grew with step 0's update do not.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from rk_testing import bundle_of, record

from reprokit.bisect import bisect_layers
from reprokit.bundle import open_bundle
from reprokit.cli import main

CONFIG = {"lr": 1e5, "warmup": 4}


def _diverged(projects, tmp_path):
    gpt = projects("rk_gpt")
    _, exc = record(gpt, CONFIG, gpt.batches(CONFIG, 60), tmp_path / "repros")
    assert exc is not None and exc.failure.kind in ("nonfinite_loss", "nonfinite_grad", "nonfinite_param")
    return bundle_of(exc)


@pytest.mark.slow
def test_layers_says_the_values_were_already_out_of_range_and_where_they_grew(projects, tmp_path):
    bundle = _diverged(projects, tmp_path)
    d = bisect_layers(open_bundle(bundle))
    first, r = d["first_nonfinite"], d["already_out_of_range"]
    assert first is not None and r is not None, d
    assert r["module"] == first["module"] and r["dtype"] == "float32"
    assert r["input_abs_max"] > 1e12, r  # the window's first step gave it values of order 1
    grew = r["grew"]
    assert grew is not None and grew["factor"] > 1e3 and grew["past_step"] == 0, grew  # step 0's update (LR 2.5e4)
    assert grew["all_params_norm_before_failure"] > 1e3 * grew["all_params_norm_start"]
    cli = CliRunner().invoke(main, ["bisect", "layers", str(bundle)])
    assert cli.exit_code == 0, cli.output
    assert "not the cause: the values were already out of range before this op" in cli.output
    assert "with the update of step 0" in cli.output and "reprokit bisect steps" in cli.output
    out = json.loads(CliRunner().invoke(main, ["bisect", "layers", str(bundle), "--json"]).output)
    assert out["already_out_of_range"]["grew"]["past_step"] == 0


@pytest.mark.slow
def test_extract_refuses_to_ship_the_overflowing_op_as_the_cause(projects, tmp_path):
    bundle = _diverged(projects, tmp_path)
    cli = CliRunner().invoke(main, ["extract", str(bundle), "-o", str(tmp_path / "cut")])
    assert cli.exit_code == 1, cli.output
    assert "no module is to blame" in cli.output and "already out of range" in cli.output, cli.output
    assert not (tmp_path / "cut").exists() or not any((tmp_path / "cut").iterdir())
    cli = CliRunner().invoke(main, ["extract", str(bundle), "-o", str(tmp_path / "cut2"), "--json"])
    assert cli.exit_code == 1
    err = json.loads(cli.stdout)["error"]
    assert err["type"] == "NothingToExtract" and err["already_out_of_range"]["grew"]["past_step"] == 0, err


@pytest.mark.slow
def test_a_module_that_overflows_values_in_range_is_still_the_culprit(projects, tmp_path):
    """The naive softmax given inputs of a few hundred (exp overflows at 88): the softmax is to blame."""
    num = projects("rk_numerics")
    _, exc = record(num, {"softmax": True}, num.batches(8, scale_from=5, scale=400.0), tmp_path, snapshot_every=4)
    d = bisect_layers(open_bundle(bundle_of(exc)))
    assert d["first_nonfinite"]["class"] == "NaiveSoftmax"
    assert d["already_out_of_range"] is None, d["already_out_of_range"]
