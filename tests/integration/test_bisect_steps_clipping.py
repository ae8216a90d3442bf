"""`bisect steps` on a nanoGPT-style loop that clips to norm 1 and sets its LR inside the step.

The LR (1e5 after a 4-step warmup) is far too high: the first update multiplies the weights by orders of
magnitude, so the loss leaves its starting level at step 1 (from ~3.6 to ~1e9) and the gradients backward makes
grow by ~1e7, while the NaN comes steps later. Every margin here is orders of magnitude, so the answers do not
depend on the CPU's last float bits.
"""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner
from rk_testing import bundle_of, record

from reprokit.bisect import bisect_steps
from reprokit.bundle import open_bundle
from reprokit.cli import main

CONFIG = {"lr": 1e5, "warmup": 4}


@pytest.fixture
def clipped(projects, tmp_path):
    gpt = projects("rk_gpt")
    _, exc = record(gpt, CONFIG, gpt.batches(CONFIG, 60), tmp_path)
    assert exc is not None and exc.failure.kind in ("nonfinite_loss", "nonfinite_grad", "nonfinite_param")
    assert exc.failure.step > 3, exc.failure
    return gpt, bundle_of(exc)


def test_grad_norm_is_the_one_before_clipping_and_lr_the_one_the_step_used(clipped):
    gpt, bundle = clipped
    d = bisect_steps(open_bundle(bundle))
    rows = {r["step"]: r for r in d["per_step"]}
    schedule = {"lr": CONFIG["lr"], "warmup": CONFIG["warmup"], "clip": 1.0}
    for step, r in rows.items():  # set inside train_step: the rate its optimizer step used, not the one at entry
        assert r["lr"] == [pytest.approx(gpt.lr_at(schedule, step))], (step, r["lr"])
    assert rows[0]["lr"] == [pytest.approx(2.5e4)]
    # backward's norm (clip_grad_norm_ then scales it to 1 for the optimizer step)
    assert rows[1]["grad_norm"] > 1e4 and rows[1]["clipped"], rows[1]
    assert rows[1]["stepped_grad_norm"] == pytest.approx(1.0, rel=1e-3)
    assert rows[1]["top_grads"][0][1] > 1e3
    assert rows[0]["grad_norm"] < 10  # the healthy first step
    finite = [r for r in d["per_step"] if r["grad_norm"] is not None and math.isfinite(r["grad_norm"])]
    assert sum(r["clipped"] for r in finite) >= len(finite) - 1


@pytest.mark.slow
def test_first_bad_step_is_where_the_trajectory_departed(clipped):
    _, bundle = clipped
    d = bisect_steps(open_bundle(bundle))
    assert d["first_bad_step"] == 1, (d["reason"], [(r["step"], r["loss"]) for r in d["per_step"]])
    assert d["reason"].startswith("loss departed"), d["reason"]
    cli = CliRunner().invoke(main, ["bisect", "steps", str(bundle)])
    assert cli.exit_code == 0, cli.output
    assert "first bad step: 1 (loss departed" in cli.output
    assert "stepped" in cli.output and "before clipping" in cli.output
    out = json.loads(CliRunner().invoke(main, ["bisect", "steps", str(bundle), "--json"]).output)
    assert out["first_bad_step"] == 1 and out["per_step"][1]["clipped"] is True
