"""Replays that survive a step that kills the process: each run of a crash bundle (or any, with --isolate) goes in a
child process, and a child that dies is judged by how (the signal) and where (the step it started last).

Each replay starts a fork server that imports torch (seconds on a 2-core machine), so the quick run (``-m "not
slow"``) keeps the bundles' validity only; every kind of death, an error raised in the child and an attempt past its
time limit run in the full suite.

The crash bundles are made as a user's would be until `reprokit recover` writes them: a real seeded run of rk_die
whose step raises at the marker is recorded, and its bundle is written again through the bundle writer with a crash
failure. Replay then imports a copy of rk_die (`--code`) whose step dies at the marker instead of raising.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from rk_testing import bundle_of, entries, record, with_failure

from reprokit import bundle as B
from reprokit.cli import main
from reprokit.isolation import KILLED_FROM_OUTSIDE
from reprokit.replayer import format_report
from reprokit.signature import Failure

PROJECTS = Path(__file__).parent.parent / "projects"
MARKER_STEP, MARKER_ROW = 6, 5


def crash(exc_type: str | None) -> Failure:
    """The failure `recover` writes for a run that died during the marker step (the contract of a crash bundle)."""
    return Failure("crash", MARKER_STEP, exc_type=exc_type, message=f"killed by {exc_type or 'an unknown cause'}",
                   detail={"last_started": MARKER_STEP, "last_finished": MARKER_STEP - 1, "signal": exc_type,
                           "fault_log": None, "rank": 0, "world_size": 1, "pid": 4242, "host": "recorded-host",
                           "recovered_from": "flight", "dropped": []})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The recorded bundle (the step raised at the marker), crash bundles made from it, and copies of rk_die whose
    step dies at the marker in each way."""
    root = tmp_path_factory.mktemp("isolation")
    sys.path.insert(0, str(PROJECTS))
    try:
        import rk_die

        _, exc = record(rk_die, {}, rk_die.batches(9, MARKER_STEP, MARKER_ROW), root / "repros", snapshot_every=4)
    finally:
        sys.path.remove(str(PROJECTS))
    source = bundle_of(exc)
    out = {"source": source}
    for name, exc_type in (("segv", "SIGSEGV"), ("abort", "SIGABRT"), ("unknown", None), ("exit", "SystemExit")):
        out[name] = with_failure(source, root / "crash", crash(exc_type), name)
    text = (source / "code" / "rk_die.py").read_text()
    for how in ("segv", "abort", "kill", "exit", "hang", "clean"):
        folder = root / f"code-{how}"
        folder.mkdir()
        (folder / "rk_die.py").write_text(text.replace('ON_MARKER = "raise"', f'ON_MARKER = "{how}"'))
        out[f"code-{how}"] = folder
    return out


def replay_json(bundle: Path, code: Path, *extra: str) -> tuple[int, dict]:
    r = CliRunner().invoke(main, ["replay", str(bundle), "--code", str(code), *entries(bundle), "--json", *extra])
    return r.exit_code, json.loads(r.output)


def test_crash_bundles_are_valid_bundles(made):
    for name in ("segv", "abort", "unknown"):
        assert B.verify(made[name]) == []
        assert B.open_bundle(made[name]).failure.kind == "crash"


@pytest.mark.slow
def test_a_segfault_at_the_recorded_step_reproduces_and_reprokit_exits_normally(made, fork_server):
    # `python -m reprokit replay` as a process of its own (forked: the fork server's torch import saved)
    proc = fork_server.reprokit("replay", made["segv"], "--code", made["code-segv"], *entries(made["segv"]),
                                env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stdout + proc.stderr  # reprokit's own exit: not -11
    assert f"replayed: the process died with SIGSEGV at step {MARKER_STEP}" in proc.stdout
    assert "died in rk_die.py:" in proc.stdout and "in _at_marker" in proc.stdout
    assert "isolation: each run in a process of its own (1 of 1 died)" in proc.stdout


@pytest.mark.slow
def test_segfault_json_carries_signal_and_step(made):
    rc, d = replay_json(made["segv"], made["code-segv"])
    assert rc == 1 and d["verdict"] == "deterministic" and d["reproduced"]
    assert d["failure"]["kind"] == "crash" and d["failure"]["exception_type"] == "SIGSEGV"
    assert d["failure"]["step"] == MARKER_STEP
    iso = d["isolation"]
    assert (iso["signal"], iso["step"], iso["attempts"], iso["child_deaths"]) == ("SIGSEGV", MARKER_STEP, 1, 1)
    death = d["per_run"][0]["death"]
    assert death["returncode"] == -11 and death["last_finished"] == MARKER_STEP - 1
    assert "Segmentation fault" in death["output_tail"]
    # the steps before the death ran and their losses were compared with the recorded ones
    assert d["fidelity"]["bit_exact"] and d["fidelity"]["steps_compared"] == 2


@pytest.mark.slow
def test_an_abort_reproduces_as_sigabrt(made):
    rc, d = replay_json(made["abort"], made["code-abort"])
    assert rc == 1 and d["verdict"] == "deterministic"
    assert (d["isolation"]["signal"], d["failure"]["exception_type"]) == ("SIGABRT", "SIGABRT")
    assert d["per_run"][0]["death"]["returncode"] == -signal.SIGABRT


@pytest.mark.slow
def test_times_n_replays_each_run_in_its_own_process_from_one_server(made):
    rc, d = replay_json(made["segv"], made["code-segv"], "--times", "2")
    assert rc == 1 and d["verdict"] == "deterministic" and d["failed_runs"] == 2 and d["determinism_checked"]
    assert [r["death"]["signal"] for r in d["per_run"]] == ["SIGSEGV", "SIGSEGV"]
    assert len({r["failure"]["step"] for r in d["per_run"]}) == 1
    iso = d["isolation"]
    assert (iso["child_starts"], iso["attempts"], iso["child_deaths"]) == (1, 2, 2)  # torch imported once


@pytest.mark.slow
def test_another_signal_is_a_different_failure(made):
    rc, d = replay_json(made["segv"], made["code-abort"])
    assert rc == 125 and d["verdict"] == "different_failure"
    assert d["failure"]["exception_type"] == "SIGABRT" and d["recorded_failure"]["exception_type"] == "SIGSEGV"


@pytest.mark.slow
def test_no_recorded_signal_and_a_child_killed_at_the_step_reproduces(made):
    rc, d = replay_json(made["unknown"], made["code-kill"])
    assert rc == 1 and d["verdict"] == "deterministic"
    assert (d["isolation"]["signal"], d["isolation"]["step"]) == ("SIGKILL", MARKER_STEP)
    assert d["isolation"]["note"] is None


@pytest.mark.slow
def test_a_python_level_death_reproduces_by_its_exception_class(made):
    rc, d = replay_json(made["exit"], made["code-exit"])
    assert rc == 1 and d["verdict"] == "deterministic"
    death = d["per_run"][0]["death"]
    assert death["signal"] is None and death["returncode"] == 70
    assert d["failure"]["exception_type"] == "SystemExit" and d["failure"]["step"] == MARKER_STEP


@pytest.mark.slow
def test_a_crash_that_replays_clean_was_killed_from_outside(made):
    rc, d = replay_json(made["unknown"], made["code-clean"])
    text = format_report(d)  # what `reprokit replay` prints without --json
    assert "NOT REPRODUCED" in text and KILLED_FROM_OUTSIDE in text
    assert "peak host memory" in text and "recorded machine:" in text
    assert "transient" not in text  # the kill note says what it was, not the transient-fault one
    iso = d["isolation"]
    assert rc == 0 and d["verdict"] == "not_reproduced" and iso["note"] == KILLED_FROM_OUTSIDE
    assert 10 * 2**20 < iso["peak_rss_bytes"] < 64 * 2**30
    assert iso["recorded_memory_bytes"] == B.open_bundle(made["unknown"]).env["memory_bytes"] > 0
    assert iso["signal"] is None and d["per_run"][0]["death"] is None


@pytest.mark.slow
def test_isolate_gives_an_ordinary_bundle_the_same_verdict(made):
    """The recorded RuntimeError bundle, replayed in process and with --isolate: same verdict, failure, losses."""
    src = made["source"]
    plain = CliRunner().invoke(main, ["replay", str(src), "--json"])
    isolated = CliRunner().invoke(main, ["replay", str(src), "--json", "--isolate"])
    assert plain.exit_code == isolated.exit_code == 1, isolated.output
    a, b = json.loads(plain.output), json.loads(isolated.output)
    for key in ("verdict", "failure", "recorded_failure", "fidelity", "device", "code"):
        assert a[key] == b[key], key
    assert [r["losses"] for r in a["per_run"]] == [r["losses"] for r in b["per_run"]]
    assert a["isolation"] is None and (b["isolation"]["attempts"], b["isolation"]["child_deaths"]) == (1, 0)


@pytest.mark.slow
def test_isolate_on_a_nan_bundle_matches_in_process(shared_nan_bundle):
    plain = CliRunner().invoke(main, ["replay", str(shared_nan_bundle), "--json"])
    isolated = CliRunner().invoke(main, ["replay", str(shared_nan_bundle), "--json", "--isolate"])
    a, b = json.loads(plain.output), json.loads(isolated.output)
    assert plain.exit_code == isolated.exit_code == 1
    assert (a["verdict"], a["failure"], a["fidelity"]) == (b["verdict"], b["failure"], b["fidelity"])
    assert b["failure"]["kind"] == "nonfinite_loss"


@pytest.mark.slow
def test_a_code_error_in_the_child_is_the_same_error_here(made, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "rk_die.py").write_text("def build(config):\n    raise ValueError('no model')\n"
                                      "def train_step(state, batch):\n    return 0\n")
    r = CliRunner().invoke(main, ["replay", str(made["segv"]), "--code", str(broken), *entries(made["segv"])])
    assert r.exit_code == 125 and "build(config) failed: ValueError: no model" in r.output


@pytest.mark.slow
def test_shrink_of_a_segfault_bundle_ends_at_the_marker_row(made, tmp_path):
    out = tmp_path / "small"
    r = CliRunner().invoke(main, ["shrink", str(made["segv"]), "-o", str(out), "--code", str(made["code-segv"]),
                                  *entries(made["segv"]), "--passes", "steps,rows", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert (d["steps_after"], d["rows_after"], d["kept_rows"]) == (1, 1, [MARKER_ROW])
    assert d["dataset_indices"] == [MARKER_STEP * 8 + MARKER_ROW]
    assert d["failure"]["kind"] == "crash" and d["failure"]["exception_type"] == "SIGSEGV"
    iso = d["isolation"]
    assert iso["child_deaths"] >= 3 and iso["child_starts"] == 1  # one server forked every candidate
    assert B.verify(out) == [] and B.open_bundle(out).failure.step == MARKER_STEP
    again = CliRunner().invoke(main, ["replay", str(out), "--json"])  # its own code: the segfaulting copy
    assert again.exit_code == 1 and json.loads(again.output)["isolation"]["signal"] == "SIGSEGV"


@pytest.mark.slow
def test_an_attempt_past_its_time_limit_is_killed_and_the_next_one_runs(made):
    """A hang costs the attempt (no verdict), not the runner: its server forks the next attempt at once."""
    from reprokit.isolation import IsolatedRunner

    recorded = B.open_bundle(made["segv"]).failure
    with IsolatedRunner() as runner:
        hung = runner.attempt(made["segv"], recorded=recorded, code=made["code-hang"], timeout=3)
        died = runner.attempt(made["segv"], recorded=recorded, code=made["code-segv"])
    assert hung.timed_out and hung.outcome is None
    assert died.outcome.same and died.outcome.death["signal"] == "SIGSEGV"
    assert (runner.starts, runner.attempts, runner.deaths) == (1, 2, 2)
