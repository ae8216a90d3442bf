"""A hard crash from end to end: a durable run dies (by its own SIGKILL, a segfault, an abort; or killed from
outside), `reprokit recover` turns its flight log into a bundle, `reprokit replay` runs it in a child process and
judges the child's death, `reprokit shrink` cuts it down to the marker row. Real processes throughout: the training
run and the reprokit commands (each forked from a server that imported torch, see tests/rk_forked.py) and their
children."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from rk_forked import ForkedRuns

from reprokit.bundle import open_bundle, verify
from reprokit.cli import main
from reprokit.isolation import KILLED_FROM_OUTSIDE

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = (ROOT / "tests" / "projects" / "rk_durable_die.py").read_text()
MARKER_ROW = 3  # the script puts its marker at x[3, 2] of step CRASH_STEP's batch
CRASH_STEP = 37


ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def forked(fork_server):
    """The server that imported torch forks the training runs and the reprokit commands (one thread each:
    ``ONE_THREAD``, which their children inherit)."""
    return fork_server


def _reprokit(forked: ForkedRuns, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m reprokit ARGS`` as its own process (forked): a child it starts may die, reprokit must not.
    ``env``: the script's own variables (DIE_HOW: how its step dies, as in training)."""
    return forked.capture(list(args), module="reprokit", cwd=cwd, env={**ONE_THREAD, **env})


def _recovered_bundle(tmp_path: Path) -> Path:
    """``reprokit recover OUT --json`` (in this process: the CLI's code, no torch import); the one bundle it wrote."""
    r = CliRunner().invoke(main, ["recover", str(tmp_path / "out"), "--json"])
    assert r.exit_code == 0, r.output
    [run] = json.loads(r.stdout)["runs"]
    assert run["status"] == "recovered", run
    assert verify(Path(run["bundle"])) == []
    return Path(run["bundle"])


def _start(forked: ForkedRuns, tmp_path: Path, crash_step: int, **env: str) -> int:
    (tmp_path / "train.py").write_text(SCRIPT)
    return forked.start(tmp_path / "train.py", [str(tmp_path / "out"), str(crash_step)], cwd=tmp_path,
                        env={**ONE_THREAD, **env})


def _log(tmp_path: Path) -> str:
    return (tmp_path / "run.log").read_text()


@pytest.mark.slow
@pytest.mark.parametrize(("how", "signame"), [("kill", "SIGKILL"), ("segv", "SIGSEGV"), ("abort", "SIGABRT")])
def test_a_run_that_dies_in_step_37_recovers_replays_its_death_and_shrinks_to_the_marker_row(forked, tmp_path, how,
                                                                                             signame):
    _start(forked, tmp_path, CRASH_STEP, DIE_HOW=how)
    assert forked.wait() == -signal.Signals[signame], _log(tmp_path)
    bundle = _recovered_bundle(tmp_path)
    recorded = open_bundle(bundle).failure
    # A SIGKILL leaves no trace in the process: the bundle says no signal; the others are named by faulthandler.
    assert (recorded.kind, recorded.step, recorded.exc_type) == ("crash", CRASH_STEP,
                                                                 None if how == "kill" else signame)

    r = _reprokit(forked, "replay", str(bundle), "--json", cwd=tmp_path, DIE_HOW=how)
    assert r.returncode == 1, r.stdout + r.stderr  # reproduced; reprokit itself exited normally
    d = json.loads(r.stdout)
    assert d["verdict"] == "deterministic" and d["reproduced"], d
    assert (d["failure"]["kind"], d["failure"]["step"], d["failure"]["exception_type"]) == ("crash", CRASH_STEP,
                                                                                            signame)
    iso = d["isolation"]
    assert (iso["signal"], iso["step"], iso["child_deaths"], iso["note"]) == (signame, CRASH_STEP, 1, None)
    if how != "kill":  # the child's faulthandler traceback names the step function's line
        assert (iso["where"] or "").startswith("train.py:") and "train_step" in iso["where"], iso
    [run] = d["per_run"]
    assert run["death"]["returncode"] == -signal.Signals[signame]
    assert run["fidelity"]["bit_exact"], run  # the steps before the death replayed as recorded

    r = _reprokit(forked, "shrink", str(bundle), "-o", str(tmp_path / "small"), "--json", cwd=tmp_path, DIE_HOW=how)
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(r.stdout)
    assert s["kept_rows"] == [MARKER_ROW], s
    assert (s["steps_after"], s["rows_after"]) == (1, 1), s
    assert (s["failure"]["kind"], s["failure"]["step"], s["failure"]["exception_type"]) == ("crash", CRASH_STEP,
                                                                                            signame)
    small = open_bundle(tmp_path / "small")
    batch, _, _ = small.step(CRASH_STEP)
    assert batch["x"].shape == (1, 4) and batch["x"][0, 2].item() == 12345.0


def _killed_from_outside(forked: ForkedRuns, tmp_path: Path, sig: signal.Signals) -> Path:
    """A run sent ``sig`` by this test while it sleeps after step 23 (a step that does nothing special); the
    bundle recover makes of it."""
    ready = tmp_path / "ready"
    pid = _start(forked, tmp_path, -1, READY=str(ready), READY_AT="23", HOLD="600")
    deadline = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ready.exists(), _log(tmp_path)
    os.kill(pid, sig)
    assert forked.wait() == -sig, _log(tmp_path)
    return _recovered_bundle(tmp_path)


@pytest.mark.slow
def test_a_run_killed_from_outside_replays_clean_and_says_it_was_killed_from_outside(forked, tmp_path):
    bundle = _killed_from_outside(forked, tmp_path, signal.SIGKILL)
    f = open_bundle(bundle).failure
    assert (f.kind, f.step, f.exc_type) == ("crash", 23, None)
    assert "after step 23 finished" in f.message and "SIGKILL from outside" in f.message

    r = _reprokit(forked, "replay", str(bundle), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert d["verdict"] == "not_reproduced" and not d["reproduced"] and d["failure"] is None, d
    assert d["isolation"]["note"] == KILLED_FROM_OUTSIDE and d["isolation"]["child_deaths"] == 0
    assert d["transient"] is False  # the note says what it was: not an unexplained transient fault


@pytest.mark.slow
def test_a_run_stopped_with_sigterm_replays_clean_and_says_it_was_stopped_from_outside(forked, tmp_path):
    # torchrun stops the other ranks with SIGTERM; the recorder's faulthandler leaves sigterm.log, so the bundle
    # names the signal. It is a death from outside as much as a SIGKILL.
    bundle = _killed_from_outside(forked, tmp_path, signal.SIGTERM)
    f = open_bundle(bundle).failure
    assert (f.kind, f.step, f.exc_type) == ("crash", 23, "SIGTERM")

    r = _reprokit(forked, "replay", str(bundle), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert d["verdict"] == "not_reproduced" and d["failure"] is None, d
    assert "from outside" in d["isolation"]["note"] and "SIGTERM" in d["isolation"]["note"], d["isolation"]
    assert d["transient"] is False
