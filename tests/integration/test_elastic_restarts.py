"""Elastic restarts (``torchrun --max-restarts 1``, gloo on the CPU): a rank raises, torchrun restarts every worker,
and the next attempt creates its Recorders again. Each attempt is a run of its own: its own run key, incidents
numbered from 0, its own incident folders with ``restart`` in every bundle."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from rk_testing import PROJECTS, env_with_checkout, torchrun

from reprokit.bundle import open_bundle
from reprokit.cli import main as cli
from reprokit.distributed import INCIDENTS_DIR

pytestmark = pytest.mark.slow  # each case is a torchrun of two ranks restarted once, then replays on two ranks


def _torchrun(out: Path, scenario: str) -> subprocess.CompletedProcess:
    return torchrun(PROJECTS / "rk_elastic_restart.py", out, scenario, cwd=out.parent, launcher=["--max-restarts", "1"],
                    timeout=150)


def _incidents(out: Path) -> list[Path]:
    return sorted(p for p in out.iterdir() if p.name.startswith("incident-"))


def _by_rank(folder: Path) -> dict[int, tuple[str, int, str]]:
    """``{rank: (failure kind, failure step, restart)}`` of an incident folder's bundles, each checked to name it."""
    found = {}
    for b in folder.iterdir():
        bundle = open_bundle(b)
        d = bundle.run["distributed"]
        assert d["incident"] == folder.name and d["world_size"] == 2, (b, d)
        assert d["rank"] not in found, f"two bundles of rank {d['rank']} in {folder}"
        found[d["rank"]] = (bundle.failure.kind, bundle.failure.step, d["restart"])
    return found


def test_the_restarted_attempt_trains_to_the_end_without_taking_the_first_attempt_s_incident(tmp_path):
    """Attempt 0: rank 1 raises at step 3; both ranks write their window into one incident folder; torchrun restarts.
    Attempt 1 trains to the end and exits 0: it must not read attempt 0's incident file as one of its own (its
    ranks would write peer bundles of steps they never failed in, and the step's rank would wait for them), nor
    wait for a rank marked attached by attempt 0."""
    out = tmp_path / "repros"
    proc = _torchrun(out, "recovers")
    log = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert "attempt 0 rank 1: IndexError" in proc.stdout, log  # (rank 0 may be killed by torchrun before it says)
    for rank in (0, 1):
        assert f"attempt 1 rank {rank}: done, bundles []" in proc.stdout, log
    assert "did not write their window" not in proc.stderr and "mark of this run" not in proc.stderr, log
    (folder,) = _incidents(out)
    assert _by_rank(folder) == {1: ("exception", 3, 0), 0: ("peer", 3, 0)}, folder
    (rank1,) = folder.glob("*rank1of2")
    d = json.loads(CliRunner().invoke(cli, ["inspect", str(rank1), "--json"]).stdout)
    assert (d["rank"], d["restart"], d["incident"]) == (1, 0, folder.name), d
    # two runs (a run key each, rank 0's mark of each), one incident: the first attempt's, numbered 0
    board = out / INCIDENTS_DIR
    keys = sorted(p.name.split(".")[0] for p in board.glob("*.run"))
    assert len(keys) == 2, sorted(p.name for p in board.iterdir())
    (key,) = [k for k in keys if k.startswith(folder.name.rsplit("-", 1)[1])]
    assert sorted(p.name for p in board.glob("*.*.json")) == [f"{key}.0.json"], sorted(os.listdir(board))


def test_two_failing_attempts_give_two_incidents_each_replaying_on_two_ranks(tmp_path, fork_server, monkeypatch):
    """Attempt 0: rank 1 raises at step 3; attempt 1: rank 0 raises at step 5 and torchrun gives up. Two incident
    folders, each with both ranks' windows and its attempt's ``restart``; each replays on two ranks and reproduces
    on the rank that failed (exit 1)."""
    out = tmp_path / "repros"
    proc = _torchrun(out, "fails-twice")
    log = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode != 0 and "attempt 1 rank 0: IndexError" in proc.stdout, log
    assert "did not write their window" not in proc.stderr, log
    first, second = _incidents(out)
    assert "-step00000003-" in first.name and "-step00000005-" in second.name, (first, second)
    assert first.name[-8:] != second.name[-8:], "each attempt names its incidents with its own run key"
    assert _by_rank(first) == {1: ("exception", 3, 0), 0: ("peer", 3, 0)}, first
    assert _by_rank(second) == {0: ("exception", 5, 1), 1: ("peer", 5, 1)}, second
    # both replays at once (each rank of each waits out its peers): `reprokit replay INCIDENT --nproc 2`, the first
    # as a process of its own (forked from the fork server: no torch import of its own), the second in this process
    # meanwhile; each starts its own torchrun of two ranks
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    argv = ["replay", str(first), "--nproc", "2", "--json"]
    done: list[subprocess.CompletedProcess] = []
    forked = threading.Thread(target=lambda: done.append(fork_server.capture(
        argv, module="reprokit", cwd=tmp_path, env=env_with_checkout(OMP_NUM_THREADS="1"), replace_env=True,
        timeout=150)))
    forked.start()
    try:
        here = CliRunner().invoke(cli, ["replay", str(second), "--nproc", "2", "--json"])
    finally:
        forked.join()
    assert done, "the forked replay raised (its traceback is above)"
    replays = [(done[0].returncode, done[0].stdout, done[0].stderr), (here.exit_code, here.stdout, here.output)]
    for (code, stdout, stderr), rank, step in zip(replays, (1, 0), (3, 5)):
        assert code == 1, stdout + stderr[-3000:]
        d = json.loads(stdout)
        assert d["verdict"] == "deterministic" and d["reproduced"], d
        assert (d["failing_rank"], d["incident"]["step"]) == (rank, step), d
        failing = next(x for x in d["ranks"] if x["rank"] == rank)
        assert failing["reproduced"] and failing["failure"]["step"] == step, failing
