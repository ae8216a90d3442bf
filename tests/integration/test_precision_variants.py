"""`bisect precision`'s fp32 / bf16 / fp16 variants run in the dtype they name, and say so when they cannot.

Models cast after they are made (``model.half()``, bfloat16 or float64 parameters, no autocast), with a step
that casts the batch to the parameters' dtype; the failure is a hand-written softmax whose ``exp`` overflows."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from rk_testing import record

from reprokit.bisect import bisect_precision
from reprokit.bundle import open_bundle
from reprokit.cli import main

NAMED = ["recorded", "fp32", "bf16", "fp16"]


def _bundle(num, tmp_path, scale: float, **cfg):
    """Train rk_numerics' naive-softmax net; inputs scaled by ``scale`` from step 6 overflow its exp."""
    _, exc = record(num, {"softmax": True, **cfg}, num.batches(10, scale_from=6, scale=scale), tmp_path,
                    snapshot_every=4)
    assert exc is not None and exc.failure.kind == "nonfinite_loss" and exc.failure.step == 6, exc
    return open_bundle(exc.bundle)


@pytest.mark.slow
def test_a_float16_model_passes_in_fp32_because_fp32_really_runs_in_float32(projects, tmp_path):
    """exp overflows float16 at 11 and float32 at 88: logits near 20 fail only in float16. The fp32 variant
    upcast the model before the restore, which cast it back to float16: it failed, and bf16 was called the fix."""
    bundle = _bundle(projects("rk_numerics"), tmp_path, 20.0, dtype="float16")
    d = bisect_precision(bundle, variants=NAMED)
    assert d["variants"] == {"recorded": "fail", "fp32": "pass", "bf16": "pass", "fp16": "fail"}, d["details"]
    assert d["smallest_fix"] == "fp32"
    assert d["dtypes"]["fp32"] == {"params": ["float32"], "loss": ["float32"], "outputs": ["float32"]}
    assert d["dtypes"]["bf16"]["params"] == ["float16"] and d["dtypes"]["bf16"]["outputs"] == ["bfloat16"]
    assert d["dtypes"]["fp16"]["outputs"] == ["float16"]
    out = CliRunner().invoke(main, ["bisect", "precision", str(bundle.path), "--variants", "recorded,fp32"])
    assert out.exit_code == 0, out.output
    assert "passed 3 steps (float32 parameters, a float32 loss, modules returning float32)" in out.output
    assert "smallest change that makes the failure go away: fp32" in out.output


@pytest.mark.slow
def test_a_variant_that_did_not_run_in_its_dtype_says_so(projects, tmp_path):
    """A step that casts the model to float16 itself runs in float16 whatever the variant did: fp32 cannot be
    tried, and is neither a pass nor a fail (nor a fix)."""
    bundle = _bundle(projects("rk_numerics"), tmp_path, 20.0, half_in_step=True)
    d = bisect_precision(bundle, variants=["recorded", "fp32"])
    assert d["variants"] == {"recorded": "fail", "fp32": "not_applied"} and d["smallest_fix"] is None
    assert d["dtypes"]["fp32"]["loss"] == ["float16"]
    assert d["details"]["fp32"].startswith("ran with float16+float32 parameters, a float16 loss")
    out = CliRunner().invoke(main, ["bisect", "precision", str(bundle.path), "--variants", "recorded,fp32", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["variants"]["fp32"] == "not_applied"


@pytest.mark.slow
def test_bfloat16_parameters_with_adamw_run_fp32_with_their_moments_upcast(projects, tmp_path):
    """Logits near 500 overflow float32 and bfloat16 alike. Upcast parameters beside bfloat16 AdamW moments made
    the fp32 replay raise inside the optimizer (a different failure) instead of answering."""
    bundle = _bundle(projects("rk_numerics"), tmp_path, 400.0, dtype="bfloat16", optimizer="adamw")
    d = bisect_precision(bundle, variants=NAMED)
    assert d["variants"] == {"recorded": "fail", "fp32": "fail", "bf16": "fail", "fp16": "fail"}, d["details"]
    assert d["dtypes"]["fp32"]["params"] == ["float32"] and d["dtypes"]["bf16"]["params"] == ["bfloat16"]
    assert d["dtypes"]["fp16"]["outputs"] == ["float16"] and d["smallest_fix"] is None


@pytest.mark.parametrize("variant", ["bf16", "fp16"])
@pytest.mark.slow
def test_a_float64_model_is_not_run_under_a_half_precision_autocast(projects, tmp_path, variant):
    """Autocast leaves float64 alone: a bf16 or fp16 variant of a float64 model runs in float64, and says so."""
    bundle = _bundle(projects("rk_numerics"), tmp_path, 2000.0, dtype="float64", optimizer="adamw")
    d = bisect_precision(bundle, variants=["recorded", "fp32", variant])
    assert d["variants"] == {"recorded": "fail", "fp32": "fail", variant: "not_applied"}, d["details"]
    assert d["dtypes"]["fp32"]["params"] == ["float32"]
    assert "(autocast leaves float64 alone)" in d["details"][variant]
    assert d["dtypes"][variant] == {"params": ["float64"], "loss": ["float64"], "outputs": ["float64"]}
