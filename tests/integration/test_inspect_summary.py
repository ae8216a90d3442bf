"""`reprokit inspect`'s summary lines say what the bundle holds: its git state, and which losses it replays."""

from __future__ import annotations

import importlib
import shutil
import sys

import git
import pytest
from click.testing import CliRunner
from rk_testing import bundle_of, record, record_mlp_nan

from reprokit.cli import main
from reprokit.shrink import shrink


def test_a_project_in_a_repository_without_commits_is_not_git_none(projects, tmp_path, monkeypatch):
    """A `git init` folder with nothing committed: there is no commit to name (it said `git None (dirty)`)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copy(projects("rk_mlp").__file__, proj / "rk_mlp_fresh.py")
    git.Repo.init(proj)
    monkeypatch.syspath_prepend(str(proj))
    monkeypatch.delitem(sys.modules, "rk_mlp_fresh", raising=False)
    mlp = importlib.import_module("rk_mlp_fresh")
    _, exc = record(mlp, {}, mlp.batches({}, 6, poison_step=4), tmp_path / "r", snapshot_every=2)
    monkeypatch.delitem(sys.modules, "rk_mlp_fresh", raising=False)
    out = CliRunner().invoke(main, ["inspect", str(bundle_of(exc))])
    assert out.exit_code == 0, out.output
    assert "git None" not in out.output
    assert ", a git repository with no commits yet (dirty)" in out.output


@pytest.mark.slow
def test_a_shrunk_bundle_says_which_of_the_runs_losses_it_holds(tmp_path):
    """Shrunk to its failing step, a bundle keeps the run's loss history (bisect steps reads it) but holds one
    step: the header said `last 12 of 40`, as if it held them."""
    bundle = record_mlp_nan(tmp_path / "r", steps=40, poison_step=39, snapshot_every=100)
    r = shrink(bundle, tmp_path / "small", passes=["steps"])
    assert r.after["steps"] == 1
    out = CliRunner().invoke(main, ["inspect", str(r.output)])
    assert out.exit_code == 0, out.output
    lines = out.output.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith("losses"))
    assert lines[i] == "losses   (last 12 of 40 recorded; this bundle holds 1 step, marked *)"
    assert [line.startswith("* step") for line in lines[i + 1:i + 13]] == [False] * 11 + [True]
    assert lines[i + 12].startswith("* step       39")
    whole = CliRunner().invoke(main, ["inspect", str(bundle)]).output.splitlines()
    assert "losses   (last 12 of 40)" in whole and not any(line.startswith("* step") for line in whole)
