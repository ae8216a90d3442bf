"""Replay verdicts: "reproduced" means the recorded signature at the recorded step; every verdict shows its fidelity."""

from __future__ import annotations

import importlib
import json
import shutil
import sys

import git
import pytest
import torch
from click.testing import CliRunner
from rk_testing import bundle_of, entries, record, reseal

import reprokit
from reprokit import bundle as B
from reprokit.bisect import bisect_commits
from reprokit.cli import main

# Appended to a copy of rk_mlp.py: the loss goes NaN one step early (the batch of step 5 starts at index 80).
EARLY = '''

_train_step = train_step


def train_step(state, batch):
    loss = _train_step(state, batch)
    early = int(batch["index"][0]) == 80 and {condition}
    return loss * float("nan") if early else loss
'''


def checkout_failing_early(bundle, tmp_path, condition="True"):
    code = tmp_path / "checkout"
    shutil.copytree(bundle / "code", code)
    with open(code / "rk_mlp.py", "a") as f:
        f.write(EARLY.format(condition=condition))
    return code


def test_same_signature_at_an_earlier_step_is_a_different_failure(nan_bundle, tmp_path):
    code = checkout_failing_early(nan_bundle, tmp_path)
    report = reprokit.replay(nan_bundle, code=code)
    assert report.runs[0].failure.kind == "nonfinite_loss" and report.runs[0].failure.step == 5
    assert report.verdict == "different_failure" and not report.reproduced and report.exit_code == 125
    assert report.fidelity["first_diverging_step"] == 5 and not report.fidelity["bit_exact"]

    result = CliRunner().invoke(main, ["replay", str(nan_bundle), "--code", str(code), *entries(nan_bundle)])
    assert result.exit_code == 125, result.output
    out = result.stdout
    assert out.startswith("DIFFERENT FAILURE: 0/1 runs failed the same way at the same step, 1 failed differently")
    assert "recorded: nonfinite_loss (loss = nan) at step 6" in out
    assert "replay hit a DIFFERENT failure: nonfinite_loss (loss = nan) at step 5" in out
    assert "first diverged at step 5" in out

    d = json.loads(CliRunner().invoke(main, ["replay", str(nan_bundle), "--code", str(code),
                                              *entries(nan_bundle), "--json"]).stdout)
    assert d["verdict"] == "different_failure" and d["exit_code"] == 125 and d["different_runs"] == 1
    assert d["recorded_failure"]["step"] == 6 and d["failure"]["step"] == 5
    assert d["per_run"][0]["verdict"] == "different_failure" and d["per_run"][0]["failure_step"] == 5


def test_times_n_with_a_mix_is_flaky_and_lists_each_runs_failure_step(nan_bundle, tmp_path):
    # Half the runs go NaN at step 5 (a different failure), the others reach the recorded failure at step 6.
    code = checkout_failing_early(nan_bundle, tmp_path, condition="__import__('os').urandom(1)[0] < 128")
    result = CliRunner().invoke(main, ["replay", str(nan_bundle), "--code", str(code),
                                         *entries(nan_bundle), "--times", "20", "--json"])
    d = json.loads(result.stdout)
    steps = [r["failure_step"] for r in d["per_run"]]
    # All-or-nothing has probability 2 * 2**-20.
    assert set(steps) == {5, 6}, steps
    assert d["verdict"] == "flaky" and result.exit_code == 1
    assert d["failed_runs"] == steps.count(6) and d["different_runs"] == steps.count(5)
    assert all(r["verdict"] == ("reproduced" if r["failure_step"] == 6 else "different_failure")
               for r in d["per_run"])

    text = CliRunner().invoke(main, ["replay", str(nan_bundle), "--code", str(code),
                                       *entries(nan_bundle), "--times", "20"]).stdout
    assert text.startswith("REPRODUCED (flaky): ")
    lines = [ln.strip() for ln in text.splitlines()]
    assert any(ln.startswith("1: ") for ln in lines) and any(ln.startswith("20: ") for ln in lines)
    assert any("reproduced at step 6" in ln for ln in lines)
    assert any("different failure at step 5: nonfinite_loss" in ln for ln in lines)


def test_every_verdict_shows_its_fidelity(nan_bundle, tmp_path):
    out = CliRunner().invoke(main, ["replay", str(nan_bundle)]).stdout
    assert "fidelity: bit-exact (3 step losses compared)" in out and "hint:" not in out
    # A fixed checkout (the NaN sanitised away): not reproduced, and the last step's loss differs from the NaN.
    fixed = tmp_path / "fixed"
    shutil.copytree(nan_bundle / "code", fixed)
    src = (fixed / "rk_mlp.py").read_text()
    (fixed / "rk_mlp.py").write_text(src.replace('model(batch["x"])', 'model(torch.nan_to_num(batch["x"]))'))
    result = CliRunner().invoke(main, ["replay", str(nan_bundle), "--code", str(fixed),
                                     *entries(nan_bundle)])
    assert result.exit_code == 0 and result.stdout.startswith("NOT REPRODUCED: 0/1")
    # Every loss before the failing step matched: said so, rather than "NOT bit-exact" beside a transient note.
    assert "fidelity: bit-exact before the failing step 6, which differs (recorded nan, replayed " in result.stdout
    # Code from another checkout may differ on purpose: no nondeterminism hint then.
    assert "state.extra" not in result.stdout


@pytest.mark.slow
def test_same_device_loss_mismatch_names_the_common_causes(projects, tmp_path):
    mod = projects("rk_outside_rng")
    _, exc = record(mod, {}, mod.batches(12, poison_step=9), tmp_path / "repros", snapshot_every=4)
    bundle = bundle_of(exc)
    report = reprokit.replay(bundle, device="cpu")
    assert report.verdict == "deterministic", "the poisoned input still fails at step 9"
    fid = report.fidelity
    assert fid["same_device"] and not fid["bit_exact"] and fid["first_diverging_step"] == 8
    assert fid["max_abs_diff"] > 0
    result = CliRunner().invoke(main, ["replay", str(bundle), "--device", "cpu"])
    assert result.exit_code == 1
    out = result.stdout
    assert out.startswith("REPRODUCED: 1/1") and "fidelity: NOT bit-exact: max abs loss diff" in out
    assert "first diverged at step 8" in out
    hint = next(ln for ln in out.splitlines() if ln.strip().startswith("hint:"))
    assert "state.extra" in hint and "outside train_step" in hint
    assert "reprokit bisect precision BUNDLE --variants deterministic" in hint

    # Recorded on a GPU, replayed on the CPU: differences are expected, no hint.
    run = json.loads((bundle / "run.json").read_text())
    run["device"] = "cuda:0"
    (bundle / "run.json").write_bytes(B.dumps(run))
    reseal(bundle)
    assert B.verify(bundle) == []
    moved = reprokit.replay(bundle, device="cpu")
    assert not moved.fidelity["same_device"] and moved.fidelity["hint"] is None
    assert not moved.fidelity["bit_exact"]




def test_precision_variant_failing_at_another_step_is_a_different_failure(nan_bundle, tmp_path):
    code = checkout_failing_early(nan_bundle, tmp_path)
    from reprokit.bisect.precision import bisect_precision

    d = bisect_precision(B.open_bundle(nan_bundle), code=code, variants=["recorded"])
    assert d["variants"]["recorded"] == "different_failure", d


# --- bisect commits: a commit that fails the same way but earlier is skipped, not "bad" ---------------------

TRAINER = '''\
import torch
from torch import nn

import reprokit

SANITIZE = {sanitize}  # commit 5 turns this off: the NaN input of step 9 reaches the model
EARLY = {early}  # commit 3 has another bug: its loss goes NaN at step 8


def build(config):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def train_step(state, batch):
    x = torch.nan_to_num(batch["x"]) if SANITIZE else batch["x"]
    loss = nn.functional.mse_loss(state.model(x).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss * float("nan") if EARLY and batch["step"] == 8 else loss
'''


@pytest.mark.slow
def test_bisect_commits_skips_a_commit_that_fails_earlier(tmp_path, monkeypatch, bisect_runner):
    proj = tmp_path / "proj"
    proj.mkdir()
    repo = git.Repo.init(proj)
    actor = git.Actor("Dev", "dev@example.com")
    shas = []
    for k in range(1, 7):
        (proj / "trainer.py").write_text(TRAINER.format(sanitize=k < 5, early=k == 3))
        repo.index.add(["trainer.py"])
        shas.append(repo.index.commit(f"commit {k}", author=actor, committer=actor).hexsha)
    monkeypatch.syspath_prepend(str(proj))
    monkeypatch.delitem(sys.modules, "trainer", raising=False)
    trainer = importlib.import_module("trainer")
    rec = reprokit.Recorder(trainer.build({}), trainer.train_step, build=trainer.build, config={},
                            out_dir=tmp_path / "r", snapshot_every=4)
    g = torch.Generator().manual_seed(3)
    with pytest.raises(reprokit.TrainingFailure) as info:
        for step in range(12):
            x = torch.randn(8, 4, generator=g)
            y = x.sum(-1)
            if step == 9:
                x[2, 1] = float("nan")
            rec.step({"x": x, "y": y, "step": step})
    monkeypatch.delitem(sys.modules, "trainer", raising=False)
    assert info.value.failure.step == 9

    r = bisect_commits(info.value.bundle, good=shas[0], bad=shas[-1], repo=proj, runner=bisect_runner)
    verdicts = {shas.index(p.sha) + 1: (p.verdict, p.reason) for p in r.probes}
    assert verdicts[3][0] == "skip", verdicts
    assert "different failure: nonfinite_loss (loss = nan) at step 8 (recorded: nonfinite_loss (loss = nan) at step 9)" \
        == verdicts[3][1]
    assert r.first_bad == shas[4], verdicts
