"""`reprokit bisect commits` on real git repositories built in temp dirs."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys

import git
import pytest
import torch
from click.testing import CliRunner
from rk_testing import entries

import reprokit
from reprokit.bisect import BisectError, bisect_commits
from reprokit.cli import main

TRAINER = '''\
import torch
from torch import nn

import reprokit

SANITIZE = {sanitize}  # commit 19 turns this off: NaN inputs reach the model


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.{layer} = nn.Linear(4, 1)

    def forward(self, x):
        return self.{layer}(x)


def build(config):
    torch.manual_seed(0)
    model = Net()
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


def train_step(state, batch):
    x = torch.nan_to_num(batch["x"]) if SANITIZE else batch["x"]
    loss = nn.functional.mse_loss(state.model(x).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss
{extra}'''

ACTOR = git.Actor("Dev", "dev@example.com")


def make_repo(path, n=32, bug_at=19, syntax_error=(), renamed=()):
    """n commits; commit k (1-based) sanitises inputs iff k < bug_at. Returns the shas, oldest first."""
    repo = git.Repo.init(path)
    shas = []
    for k in range(1, n + 1):
        src = TRAINER.format(sanitize=k < bug_at, layer="linear" if k in renamed else "fc",
                             extra="\n\ndef broken(:\n    pass\n" if k in syntax_error else "")
        (path / "trainer.py").write_text(src)
        (path / "CHANGES").write_text(f"change {k}\n")
        repo.index.add(["trainer.py", "CHANGES"])
        shas.append(repo.index.commit(f"commit {k}", author=ACTOR, committer=ACTOR).hexsha)
    return repo, shas


def batches():
    g = torch.Generator().manual_seed(3)
    for step in range(12):
        x = torch.randn(8, 4, generator=g)
        y = x.sum(-1)
        if step == 9:
            x[2, 1] = float("nan")  # a corrupt input that sanitising used to hide
        yield {"x": x, "y": y}


def record_at(proj, out, monkeypatch):
    """Record the failure of ``proj``'s trainer.py as it is now (in-process, as a user would); the bundle's path.
    (Shared by the bisect-commits test modules.)"""
    monkeypatch.syspath_prepend(str(proj))
    monkeypatch.delitem(sys.modules, "trainer", raising=False)
    # No __pycache__ in the repository (where Python writes bytecode): it would read as an untracked file the tests'
    # "nothing left behind" checks blame on the bisect.
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    trainer = importlib.import_module("trainer")
    rec = reprokit.Recorder(trainer.build({}), trainer.train_step, build=trainer.build, config={}, out_dir=out,
                            snapshot_every=4)
    with pytest.raises(reprokit.TrainingFailure) as info:
        for b in batches():
            rec.step(b)
    monkeypatch.delitem(sys.modules, "trainer", raising=False)
    return info.value.bundle


@pytest.fixture
def recorded(tmp_path, monkeypatch):
    """Build a repo, record the failure at its HEAD (in-process, as a user would), return (repo, shas, bundle), run
    from inside the repo."""

    def go(**kw):
        proj = tmp_path / "proj"
        proj.mkdir()
        repo, shas = make_repo(proj, **kw)
        bundle = record_at(proj, tmp_path / "r", monkeypatch)
        monkeypatch.chdir(proj)  # where a user bisects from: the repository holding the current folder
        return repo, shas, bundle

    return go


@pytest.mark.slow
def test_finds_commit_19_of_32_within_the_bound(recorded, bisect_runner):
    repo, shas, bundle = recorded()
    r = bisect_commits(bundle, good=shas[0], bad=shas[-1], runner=bisect_runner)
    assert r.first_bad == shas[18] and r.candidates == [shas[18]]
    assert r.first_bad_info["subject"] == "commit 19" and r.first_bad_info["files"] == ["CHANGES", "trainer.py"]
    assert r.first_bad_info["author"] == "Dev <dev@example.com>"
    search = [p for p in r.probes if p.role == "search"]
    assert len(search) <= math.ceil(math.log2(31)), "binary search over the 31 commits in good..bad"
    # A plain binary search needs ceil(log2 N)+1 = 6 replays; checking BOTH ends first costs one more
    # (the README's `bisect commits` section).
    assert r.replays <= math.ceil(math.log2(31)) + 2
    assert [p.role for p in r.probes[:2]] == ["bad end", "good end"]
    assert all(p.verdict == ("bad" if shas.index(p.sha) >= 18 else "good") for p in r.probes)


@pytest.mark.slow
def test_skips_unimportable_and_unloadable_commits_and_still_answers(recorded, bisect_runner):
    repo, shas, bundle = recorded(syntax_error=(16, 24), renamed=(25,))
    r = bisect_commits(bundle, good=shas[0], bad=shas[-1], runner=bisect_runner)
    assert r.first_bad == shas[18], [(shas.index(p.sha) + 1, p.verdict, p.reason) for p in r.probes]
    reasons = {shas.index(p.sha) + 1: p.reason for p in r.probes if p.verdict == "skip"}
    assert "SyntaxError" in reasons[16] and "SyntaxError" in reasons[24]
    assert "does not fit" in reasons[25] and "linear.weight" in reasons[25]
    assert r.replays <= math.ceil(math.log2(31)) + 2 + len(reasons)


@pytest.mark.slow
def test_ambiguous_answer_lists_the_candidates(recorded):
    # Commit 4 cannot be imported and sits right before the first bad commit (5): either could be first.
    repo, shas, bundle = recorded(n=8, bug_at=5, syntax_error=(4,))
    result = CliRunner().invoke(main, ["bisect", "commits", str(bundle), "--good", shas[0], "--bad", shas[-1],
                                       *entries(bundle), "--json"])
    d = json.loads(result.output)
    assert d["first_bad"] is None and d["candidates"] == [shas[3], shas[4]] and d["skipped"] == [shas[3]]
    assert "SyntaxError" in next(p["reason"] for p in d["probes"] if p["sha"] == shas[3])


@pytest.mark.slow
def test_wrong_ends_are_refused_with_a_clear_message(recorded, bisect_runner):
    repo, shas, bundle = recorded(n=8, bug_at=5)
    with pytest.raises(BisectError, match="the bad end .* does not fail the same way"):
        bisect_commits(bundle, good=shas[0], bad=shas[2], runner=bisect_runner)
    with pytest.raises(BisectError, match="the good end .* does not pass"):
        bisect_commits(bundle, good=shas[5], bad=shas[-1], runner=bisect_runner)
    with pytest.raises(BisectError, match="not a revision"):
        bisect_commits(bundle, good="no-such-tag", bad=shas[-1], runner=bisect_runner)


@pytest.mark.slow
def test_users_working_tree_is_untouched(recorded, tmp_path):
    repo, shas, bundle = recorded(n=8, bug_at=5)
    proj = tmp_path / "proj"
    (proj / "CHANGES").write_text("my uncommitted edit\n")
    (proj / "scratch.txt").write_text("untracked notes\n")
    (proj / "trainer.py").write_text((proj / "trainer.py").read_text() + "\n# staged edit\n")
    repo.index.add(["trainer.py"])
    before = (repo.git.status("--porcelain"), repo.head.commit.hexsha, repo.active_branch.name,
              repo.git.stash("list"), (proj / "trainer.py").read_text())
    result = CliRunner().invoke(main, ["bisect", "commits", str(bundle), "--good", shas[0], "--bad", "HEAD",
                                       "--repo", str(proj), *entries(bundle), "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert d["first_bad"] == shas[4] and {"candidates", "probes", "replays"} <= d.keys()
    assert {"sha", "verdict", "reason", "seconds"} <= d["probes"][0].keys()
    after = (repo.git.status("--porcelain"), repo.head.commit.hexsha, repo.active_branch.name,
             repo.git.stash("list"), (proj / "trainer.py").read_text())
    assert after == before
    assert (proj / "CHANGES").read_text() == "my uncommitted edit\n" and (proj / "scratch.txt").exists()
    assert len(repo.git.worktree("list").splitlines()) == 1, "no worktree left behind"


@pytest.mark.slow
def test_plain_git_bisect_run_gives_the_same_answer(recorded, tmp_path, bisect_runner):
    """The README's recipe: `git bisect run reprokit replay BUNDLE --code .` (exit codes 1/0/125 fit). Each
    `python -m reprokit` git starts is forked from the rank server (``rk_ranks.stand_in``: no torch import each).
    Commit 4, just before the bug, does not import and is git's first probe: its replay must exit 125 (skip), which
    leaves commits 4 and 5 both possible; were it 1 (bad), git would name commit 4, a wrong answer."""
    from rk_ranks import stand_in

    repo, shas, bundle = recorded(n=8, bug_at=5, syntax_error=(4,))
    python, env = stand_in(dict(os.environ))
    repo.git.bisect("start", shas[-1], shas[0])
    try:
        status, out, _ = repo.git.bisect("run", *python, "-m", "reprokit", "replay", str(bundle), "--code", ".",
                                         *entries(bundle), env=env, with_extended_output=True, with_exceptions=False)
        log = repo.git.bisect("log")
    finally:
        repo.git.bisect("reset")
    assert status != 0 and f"git bisect skip {shas[3]}" in log, (status, log)  # git: "We cannot bisect more!"
    assert "is the first bad commit" not in out and "first bad commit could be any of" in out, out
    assert shas[3] in out.split("could be any of")[1] and shas[4] in out.split("could be any of")[1], out
    r = bisect_commits(bundle, good=shas[0], bad=shas[-1], runner=bisect_runner)
    assert r.first_bad is None and sorted(r.candidates) == sorted(shas[3:5]), (r.first_bad, r.candidates)


def test_ctrl_c_leaves_no_worktree_behind(recorded, monkeypatch):
    from reprokit.bisect import commits

    repo, shas, bundle = recorded(n=4, bug_at=3)

    def interrupted(self, code):
        assert code.is_dir(), "the worktree exists while the probe runs"
        raise KeyboardInterrupt

    monkeypatch.setattr(commits._Prober, "_replay", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bisect_commits(bundle, good=shas[0], bad=shas[-1])
    assert len(repo.git.worktree("list").splitlines()) == 1
    assert repo.head.commit.hexsha == shas[-1] and not repo.is_dirty(untracked_files=True)


def test_a_runner_of_the_callers_must_run_its_server_in_an_empty_folder(tmp_path):
    """A shared fork server started in the caller's folder would have that folder first on its sys.path: refused
    before anything runs."""
    from reprokit.isolation import IsolatedRunner

    with IsolatedRunner() as runner, pytest.raises(ValueError, match="empty_cwd=True"):
        bisect_commits(tmp_path / "no-bundle-needed", good="HEAD~1", bad="HEAD", runner=runner)
    assert runner.starts == 0
