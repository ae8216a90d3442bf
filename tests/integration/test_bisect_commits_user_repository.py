"""`reprokit bisect commits` bisects the user's repository, never one the bundle names, and runs no git hook
(before, a bundle's env.json ``git.root`` chose the repository, whose post-checkout hook ran during
``git worktree add`` and whose code was replayed under the user's ``--entry``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import git
import pytest
from click.testing import CliRunner
from rk_testing import entries, reseal

import reprokit
from reprokit.bisect import BisectError, bisect_commits
from reprokit.cli import main

sys.path.insert(0, str(Path(__file__).parent))
from test_bisect_commits import ACTOR, make_repo, record_at  # noqa: E402

sys.path.pop(0)


def hook(repo: git.Repo, marker: Path) -> None:
    """A post-checkout hook (what ``git worktree add`` runs) that leaves ``marker`` behind."""
    p = Path(repo.git_dir) / "hooks" / "post-checkout"
    p.parent.mkdir(exist_ok=True)
    p.write_text(f"#!/bin/sh\necho \"hook ran in $(pwd)\" >> '{marker}'\n")
    p.chmod(0o755)


record = record_at  # the bundle's git.root is the project it was recorded in


def point_at(bundle: Path, root: Path) -> None:
    """A sender's edit: env.json's git.root names another repository; the bundle re-sealed, so it verifies."""
    env = json.loads((bundle / "env.json").read_text())
    env["git"] = {**env["git"], "root": str(root), "code_subdir": "."}
    (bundle / "env.json").write_text(json.dumps(env))
    reseal(bundle)
    assert reprokit.verify(bundle) == []


@pytest.mark.slow
def test_a_bundle_naming_another_repository_does_not_choose_what_is_bisected(tmp_path, monkeypatch):
    """The attacker's repository has the same file names (so --entry fits), a post-checkout hook and code that
    leaves a marker when imported: bisecting from the user's repository touches none of it."""
    user = tmp_path / "user"
    user.mkdir()
    repo, shas = make_repo(user, n=2, bug_at=2)
    evil = tmp_path / "evil"
    evil.mkdir()
    imported = tmp_path / "IMPORTED"
    evil_repo, _ = make_repo(evil, n=2, bug_at=2)
    # The attacker's HEAD leaves a marker when its trainer.py is imported (its code replayed as the user's).
    (evil / "trainer.py").write_text(f"import pathlib\npathlib.Path({str(imported)!r}).write_text('x')\n"
                                     + (evil / "trainer.py").read_text())
    evil_repo.index.add(["trainer.py"])
    evil_repo.index.commit("evil", author=ACTOR, committer=ACTOR)
    ran = tmp_path / "HOOK_RAN"
    hook(evil_repo, ran)
    bundle = record(user, tmp_path / "r", monkeypatch)
    point_at(bundle, evil)
    monkeypatch.chdir(user)
    result = CliRunner().invoke(main, ["bisect", "commits", str(bundle), "--good", "HEAD~1", "--bad", "HEAD",
                                       *entries(bundle), "--json"])
    assert not ran.exists(), f"the bundle's repository's hook ran: {ran.read_text()}"
    assert not imported.exists(), "code of the bundle's repository was replayed"
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["first_bad"] == shas[1], "the user's repository was bisected"
    assert len(evil_repo.git.worktree("list").splitlines()) == 1
    # A relative git.root (resolved against the current folder, before) names nothing either: from a folder
    # outside any repository, where "../evil" is the attacker's, the answer is an error.
    point_at(bundle, Path("../evil"))
    (tmp_path / "away").mkdir()
    monkeypatch.chdir(tmp_path / "away")
    with pytest.raises(BisectError, match="is not inside a git repository"):
        bisect_commits(bundle, good="HEAD~1", bad="HEAD")
    assert not ran.exists() and not imported.exists()


@pytest.mark.slow
def test_no_hook_of_the_users_own_repository_runs(tmp_path, monkeypatch, bisect_runner):
    proj = tmp_path / "proj"
    proj.mkdir()
    repo, shas = make_repo(proj, n=2, bug_at=2)
    ran = tmp_path / "HOOK_RAN"
    hook(repo, ran)
    bundle = record(proj, tmp_path / "r", monkeypatch)
    monkeypatch.chdir(proj / ".git")  # anywhere inside the repository: its top level is bisected
    r = bisect_commits(bundle, good=shas[0], bad="HEAD", runner=bisect_runner)
    assert r.first_bad == shas[1] and [p.role for p in r.probes] == ["bad end", "good end"]
    assert not ran.exists(), f"a hook ran during bisection: {ran.read_text()}"
    # The hook is live: plain git runs it on the same command reprokit used.
    repo.git.worktree("add", "--detach", str(tmp_path / "wt"), shas[0])
    assert ran.exists()


def test_outside_any_repository_the_error_asks_for_repo(tmp_path, monkeypatch):
    """The bundle names a real repository, but without --repo outside any repository the answer is an error."""
    proj = tmp_path / "proj"
    proj.mkdir()
    make_repo(proj, n=4, bug_at=3)
    bundle = record(proj, tmp_path / "r", monkeypatch)
    away = tmp_path / "away"
    away.mkdir()
    with pytest.raises(git.InvalidGitRepositoryError):
        git.Repo(away, search_parent_directories=True)  # the premise: no repository holds it
    monkeypatch.chdir(away)
    result = CliRunner().invoke(main, ["bisect", "commits", str(bundle), "--good", "HEAD~3", "--bad", "HEAD",
                                       *entries(bundle), "--json"])
    assert result.exit_code == 2, result.output
    err = json.loads(result.stdout)["error"]
    assert err["type"] == "BisectError" and err["exit_code"] == 2
    assert f"{away} is not inside a git repository" in err["message"] and "pass --repo PATH" in err["message"]


def test_a_repository_without_the_recorded_commit_says_where_the_bundle_was_recorded(tmp_path, monkeypatch):
    proj = tmp_path / "proj"
    proj.mkdir()
    make_repo(proj, n=4, bug_at=3)
    bundle = record(proj, tmp_path / "r", monkeypatch)
    other = tmp_path / "other"
    other.mkdir()
    o = git.Repo.init(other)
    (other / "README").write_text("x\n")
    o.index.add(["README"])
    o.index.commit("only", author=ACTOR, committer=ACTOR)
    monkeypatch.chdir(other)
    with pytest.raises(BisectError, match=rf"'HEAD~3' is not a revision of {other}.*recorded in '{proj}' at "
                                          r"commit [0-9a-f]{10}, which .* does not have.*--repo"):
        bisect_commits(bundle, good="HEAD~3", bad="HEAD")
