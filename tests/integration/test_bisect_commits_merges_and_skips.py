"""`reprokit bisect commits` on histories with merges, and on commits that cannot be tested."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import git
import pytest

from reprokit.bisect import BisectError, bisect_commits

sys.path.insert(0, str(Path(__file__).parent))
from test_bisect_commits import ACTOR, TRAINER, record_at  # noqa: E402

sys.path.pop(0)


def _write(path, sanitize, note, extra=""):
    (path / "trainer.py").write_text(TRAINER.format(sanitize=sanitize, layer="fc", extra=extra))
    (path / "CHANGES").write_text(note)


def _commit(repo, msg, parents=None):
    repo.index.add(["trainer.py", "CHANGES"])
    kw = {"parent_commits": parents} if parents else {}
    return repo.index.commit(msg, author=ACTOR, committer=ACTOR, **kw)


def _record(proj, out, monkeypatch):
    bundle = record_at(proj, out, monkeypatch)
    monkeypatch.chdir(proj)  # where a user bisects from: the repository holding the current folder
    return bundle


def _merge_repo(path, bug_branch_len, other_branch_len, bug_on_side):
    """root -> (main: M1..Mk) and (side: S1..Sj) -> merge. The bug comes with the first commit of one branch.

    Returns (repo, root, culprit, merge)."""
    repo = git.Repo.init(path)
    _write(path, True, "root\n")
    root = _commit(repo, "root")
    main_len, side_len = (other_branch_len, bug_branch_len) if bug_on_side else (bug_branch_len, other_branch_len)
    side = root
    culprit = None
    for k in range(side_len):
        _write(path, not bug_on_side, f"side {k}\n")
        side = _commit(repo, f"side {k}", parents=(side,))
        if bug_on_side and k == 0:
            culprit = side
    main = root
    for k in range(main_len):
        _write(path, bug_on_side, f"main {k}\n")
        main = _commit(repo, f"main {k}", parents=(main,))
        if not bug_on_side and k == 0:
            culprit = main
    _write(path, False, "merged\n")
    merge = _commit(repo, "merge side", parents=(main, side))
    repo.head.reset(merge, index=True, working_tree=True)
    return repo, root, culprit, merge


@pytest.mark.slow
def test_culprit_on_one_side_of_a_merge_is_found_not_the_merge(tmp_path, monkeypatch, bisect_runner):
    """A short branch brought the bug, a long one did not: probing the long one's commits (good) must not clear
    the short one's. The first bad commit is the branch commit, never the merge (one of whose parents is bad).
    (Every other shape of history: test_search_over_every_culprit_of_a_history_with_merges, without git.)"""
    proj = tmp_path / "proj"
    proj.mkdir()
    repo, root, culprit, merge = _merge_repo(proj, 1, 5, bug_on_side=False)
    bundle = _record(proj, tmp_path / "r", monkeypatch)
    r = bisect_commits(bundle, good=root.hexsha, bad=merge.hexsha, runner=bisect_runner)
    seen = [(repo.commit(p.sha).summary, p.verdict) for p in r.probes]
    assert r.first_bad == culprit.hexsha, seen
    assert all(p.verdict == "bad" for p in r.probes if repo.is_ancestor(culprit.hexsha, p.sha)), seen


def _dag(spec):
    """Parents lists (positions, parents first) from ``spec``: one tuple of parent positions per commit."""
    return [list(ps) for ps in spec]


def _descendants(parents, c):
    out = {c}
    for i, ps in enumerate(parents):
        if any(p in out for p in ps):
            out.add(i)
    return out


# Histories whose last commit is the bad end: linear, one merge of branches of different lengths (either first
# parent), two merges in a row, a criss-cross.
HISTORIES = {
    "linear": [(), (0,), (1,), (2,), (3,), (4,), (5,), (6,)],
    "short side": [(), (), (1,), (2,), (3,), (4,), (5, 0)],
    "short main": [(), (0,), (1,), (2,), (3,), (), (5, 4)],
    "two merges": [(), (), (0, 1), (), (3,), (2, 4), (5,)],
    "criss-cross": [(), (), (0, 1), (1, 0), (2, 3)],
}


@pytest.mark.parametrize("name", list(HISTORIES))
def test_search_over_every_culprit_of_a_history_with_merges(name):
    """Every commit as the culprit (bad = it and its descendants): the search names it, never a later commit."""
    from reprokit.bisect.commits import _search

    parents = _dag(HISTORIES[name])
    shas = [f"c{i}" for i in range(len(parents))]
    for culprit in range(len(parents)):
        bad = _descendants(parents, culprit)
        if len(parents) - 1 not in bad:
            continue  # the bad end must be bad
        probed = []

        def verdict(sha, bad=bad, probed=probed):
            probed.append(sha)
            return "bad" if int(sha[1:]) in bad else "good"

        first, cands, skipped = _search(shas, parents, verdict)
        assert (first, cands, skipped) == (shas[culprit], [shas[culprit]], []), (name, culprit, probed)
        assert len(set(probed)) == len(probed) <= len(parents) - 1


def test_search_with_a_skip_beside_the_culprit_lists_both_and_decides_nothing():
    from reprokit.bisect.commits import _search

    parents = _dag(HISTORIES["short side"])
    shas = [f"c{i}" for i in range(len(parents))]
    bad = _descendants(parents, 2)  # c1 cannot be tested: c1 or c2 brought the bug
    first, cands, skipped = _search(shas, parents,
                                    lambda s: "skip" if s == "c1" else "bad" if int(s[1:]) in bad else "good")
    assert first is None and cands == ["c1", "c2"] and skipped == ["c1"]


@pytest.mark.slow
def test_a_commit_that_imports_a_file_it_did_not_commit_is_skipped_not_run_with_the_callers_copy(tmp_path,
                                                                                                 monkeypatch):
    """Commit 3 imports ``numerics``, a file committed only in commit 4 (a forgotten ``git add``). Bisecting from
    the project's own folder (where the file now is) must not let commit 3 import the caller's copy: it does not
    build, so it is skipped, and the answer is the commit that really brought the bug (5)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    repo = git.Repo.init(proj)
    shas = []
    for k in range(1, 7):
        # From commit 3 the flag comes from numerics.py; the caller's copy (HEAD's) has the bug.
        extra = "\nfrom numerics import SANITIZE  # noqa\n" if k >= 3 else ""
        _write(proj, True, f"change {k}\n", extra=extra)
        files = ["trainer.py", "CHANGES"]
        if k >= 4:
            (proj / "numerics.py").write_text(f"SANITIZE = {k < 5}\n")
            files.append("numerics.py")
        repo.index.add(files)
        shas.append(repo.index.commit(f"commit {k}", author=ACTOR, committer=ACTOR).hexsha)
    bundle = _record(proj, tmp_path / "r", monkeypatch)
    monkeypatch.chdir(proj)  # where a user runs it from: numerics.py (SANITIZE = False) is here
    r = bisect_commits(bundle, good=shas[0], bad=shas[-1])
    verdicts = {shas.index(p.sha) + 1: (p.verdict, p.reason) for p in r.probes}
    assert r.first_bad == shas[4], verdicts
    assert verdicts[3][0] == "skip" and "numerics" in verdicts[3][1], verdicts


FLAKY_STEP = '''
_real_step = train_step


def train_step(state, batch):  # noqa: F811 - the NaN gets through on 2 runs in 3 (a counter outside the state)
    if not SANITIZE and torch.isnan(batch["x"]).any():
        import pathlib
        p = pathlib.Path({counter!r})
        n = int(p.read_text()) + 1 if p.exists() else 1
        p.write_text(str(n))
        if n % 3 == 0:
            batch = {{**batch, "x": torch.nan_to_num(batch["x"])}}
    return _real_step(state, batch)
'''


@pytest.mark.slow
def test_a_failure_that_does_not_recur_on_every_replay_is_refused_at_the_bad_end(tmp_path, monkeypatch, bisect_runner):
    """Every commit is judged on one replay, so a flaky failure would let a lucky pass call a bad commit good (here
    commit 3, the culprit, passes on the third run overall). The bad end is replayed three times first."""
    proj = tmp_path / "proj"
    proj.mkdir()
    repo = git.Repo.init(proj)
    shas = []
    for k in range(1, 7):
        _write(proj, k < 3, f"change {k}\n", extra=FLAKY_STEP.format(counter=str(tmp_path / "runs")))
        shas.append(_commit(repo, f"commit {k}").hexsha)
    bundle = _record(proj, tmp_path / "r", monkeypatch)
    with pytest.raises(BisectError, match=r"bad end .* failed the same way in 2 of 3 replays.*deterministic"):
        bisect_commits(bundle, good=shas[0], bad=shas[-1], runner=bisect_runner)
    assert len(repo.git.worktree("list").splitlines()) == 1


@pytest.mark.slow
def test_a_bug_in_uncommitted_changes_is_named_when_the_bad_end_passes(tmp_path, monkeypatch, bisect_runner):
    """Recorded from a dirty tree whose uncommitted edit is the bug: HEAD passes, and the error says why."""
    proj = tmp_path / "proj"
    proj.mkdir()
    repo = git.Repo.init(proj)
    shas = []
    for k in range(1, 4):
        _write(proj, True, f"change {k}\n")
        shas.append(_commit(repo, f"commit {k}").hexsha)
    _write(proj, False, "change 3\n")  # the bug, never committed
    bundle = _record(proj, tmp_path / "r", monkeypatch)
    with pytest.raises(BisectError, match=r"bad end .* does not fail the same way \(good.*uncommitted changes "
                                          r"\(trainer.py\): no commit holds them"):
        bisect_commits(bundle, good=shas[0], bad="HEAD", repo=proj, runner=bisect_runner)


def _reprokit_processes_below(pid):
    """The live processes below ``pid`` that run reprokit, as {pid: command line} (from /proc: each process's
    parent; gitpython's own ``git cat-file`` helpers are left out)."""
    parent, cmdline = {}, {}
    for d in Path("/proc").iterdir():
        try:
            parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
    out, todo = {}, [pid]
    while todo:
        ppid = todo.pop()
        kids = [c for c, pp in parent.items() if pp == ppid]
        out.update({k: cmdline[k] for k in kids if "reprokit" in cmdline[k]})
        todo += kids
    return out


HANGING_STEP = '''
_real_step = train_step


def train_step(state, batch):  # noqa: F811 - a deadlock, as far as the bisect can tell (a worker process waiting too)
    import pathlib
    import subprocess
    import time
    pathlib.Path({pid_file!r}).write_text(str(subprocess.Popen(["sleep", "600"]).pid))
    time.sleep(600)
    return _real_step(state, batch)
'''


def _gone(pid, within_s=10.0):
    """Whether process ``pid`` has ended (a zombie counts) within ``within_s`` seconds."""
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_a_commit_whose_replay_hangs_is_skipped_at_its_time_limit_and_the_next_probe_runs(tmp_path, monkeypatch):
    """Commit 2's step never returns (and has started a process of its own): its replay is killed at --timeout with
    that process, and the commit skipped with that reason; the probes after it still run (the bad end, commit 3, is
    where the bug came in), and no process is left behind (an orphan would have left the tree: its pid is checked)."""
    proj = tmp_path / "proj"
    proj.mkdir()
    repo = git.Repo.init(proj)
    shas = []
    for k in range(1, 5):
        _write(proj, k < 3, f"change {k}\n",
               extra=HANGING_STEP.format(pid_file=str(tmp_path / "worker.pid")) if k == 2 else "")
        shas.append(_commit(repo, f"commit {k}").hexsha)
    bundle = _record(proj, tmp_path / "r", monkeypatch)
    before = _reprokit_processes_below(os.getpid())  # other tests' fork servers, shared by this process
    r = bisect_commits(bundle, good=shas[0], bad=shas[-1], timeout=20)
    verdicts = {shas.index(p.sha) + 1: (p.verdict, p.reason) for p in r.probes}
    assert verdicts[2] == ("skip", "replay timed out after 20s"), verdicts
    assert verdicts[3][0] == "bad" and verdicts[4][0] == "bad", verdicts
    assert r.first_bad is None and r.candidates == shas[1:3] and r.skipped == [shas[1]], verdicts
    left = {pid: cmd for pid, cmd in _reprokit_processes_below(os.getpid()).items() if pid not in before}
    assert left == {}, "a replay's process or the fork server outlived the bisect"
    assert _gone(int((tmp_path / "worker.pid").read_text())), "the hung replay's own process outlived its time limit"
    assert len(repo.git.worktree("list").splitlines()) == 1


@pytest.mark.slow
def test_a_commit_of_a_vendored_reprokit_is_probed_with_that_reprokit(tmp_path, monkeypatch, bisect_runner):
    """The project carries its own copy of reprokit (as reprokit's own repository does); commit 3 changes only that
    copy, and that change is the bug. Every probe must run the commit's reprokit, as ``python -m reprokit`` started
    in its checkout would, not the one the fork server imported: the bisect names commit 3."""
    import shutil

    import reprokit

    proj = tmp_path / "proj"
    proj.mkdir()
    shutil.copytree(Path(reprokit.__file__).parent, proj / "reprokit", ignore=shutil.ignore_patterns("__pycache__"))
    init = proj / "reprokit" / "__init__.py"
    clean = init.read_text()
    repo = git.Repo.init(proj)
    shas = []
    for k in range(1, 5):
        _write(proj, True, f"change {k}\n", extra="\nSANITIZE = not getattr(reprokit, 'RAW_INPUTS', False)\n")
        init.write_text(clean + ("\nRAW_INPUTS = True  # the vendored copy's bug\n" if k >= 3 else ""))
        repo.git.add("-A")
        shas.append(repo.index.commit(f"commit {k}", author=ACTOR, committer=ACTOR).hexsha)
    monkeypatch.setattr(reprokit, "RAW_INPUTS", True, raising=False)  # recorded with HEAD's copy
    bundle = _record(proj, tmp_path / "r", monkeypatch)
    monkeypatch.delattr(reprokit, "RAW_INPUTS")
    r = bisect_commits(bundle, good=shas[0], bad=shas[-1], runner=bisect_runner)
    verdicts = {shas.index(p.sha) + 1: (p.verdict, p.reason) for p in r.probes}
    assert r.first_bad == shas[2], verdicts
    assert not hasattr(reprokit, "RAW_INPUTS")  # the caller's reprokit was never the copy
