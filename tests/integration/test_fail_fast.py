"""Fail fast under torchrun (gloo, 2 CPU processes): once every rank's window of an incident is written, no rank
waits for the backend's timeout (``Recorder(on_incident="abort")``, the default), and ``on_incident="wait"`` keeps
the old behaviour. The project is ``tests/projects/rk_fail_fast.py``: rank 1 raises inside its forward at step 17,
its ``finally`` destroys the process group (or first waits in a barrier, as scripts that save a final checkpoint do);
the process group's timeout is 600 s, so only reprokit can end the job early."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import reprokit
from reprokit.cli import main as cli
from reprokit.distributed.incident import free_port

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ROOT / "tests" / "projects" / "rk_fail_fast.py"
BOUND_S = 30.0
"""From rank 1's error to torchrun's exit, at most (the acceptance bound; it takes about 10 s here)."""

pytestmark = pytest.mark.slow


class _Launch:
    """torchrun forked from this test process's fork server (``rk_forked.shared``: the launcher pays no torch import
    of its own; nor do its ranks, forked from the rank server, ``rk_ranks``), in a session of its own. What the tests
    use of ``subprocess.Popen``: ``pid``, ``poll``, ``wait``, ``returncode``."""

    def __init__(self, argv: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> None:
        from rk_forked import shared

        self._server = shared()
        self.returncode: int | None = None
        log.write_text("")  # there from the start (the run appends to it), for the tests that read it while it runs
        self.pid = self._server.start(None, argv, module="torch.distributed.run", cwd=cwd, env=env, replace_env=True,
                                      log=log, new_session=True)

    def poll(self) -> int | None:
        if self.returncode is None and _ended(self.pid):  # the server reaps it and reports its exit status
            self.returncode = self._server.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("torchrun", timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


def _start(out: Path, on_incident: str, exit_path: str, device: str = "cpu", failure: str = "raise",
           launcher: tuple[str, ...] = (), step: int = 17) -> tuple[_Launch, Path]:
    """torchrun in a session of its own (a test that stops it kills every worker, never an orphan left blocked)."""
    from rk_ranks import forks_ranks, torchrun_argv

    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.parent / f"{on_incident}-{exit_path}.log"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests' / 'projects'}", "OMP_NUM_THREADS": "1"}
    rank = [str(PROJECT), str(out), on_incident, device, exit_path, failure, str(step)]
    if forks_ranks():
        rank, env = torchrun_argv(PROJECT, rank[1:], env)
    proc = _Launch(["--nproc-per-node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                    *launcher, *rank], cwd=out.parent, env=env, log=log)
    return proc, log


def _error_time(log: Path) -> float | None:
    """The wall-clock time rank 1 raised at (the project prints it just before)."""
    m = re.search(r"rank 1 raises at step 17 at t=([0-9.]+)", log.read_text(errors="replace"))
    return float(m.group(1)) if m else None


def _run(out: Path, on_incident: str, exit_path: str, limit_s: float = 240,
         device: str = "cpu") -> tuple[int, float, str]:
    """(exit code, seconds from rank 1's error to torchrun's exit, output)."""
    proc, log = _start(out, on_incident, exit_path, device)
    try:
        code = proc.wait(timeout=limit_s)
    finally:
        _stop(proc)
    ended = time.time()
    raised = _error_time(log)
    assert raised is not None, log.read_text()[-3000:]
    return code, ended - raised, log.read_text(errors="replace")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc): torchrun starts its workers in sessions of their own, so killing
    its process group alone would leave them orphaned, blocked in their collectives."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stop(proc: _Launch) -> None:
    workers = _descendants(proc.pid)
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _incident(out: Path) -> Path:
    (folder,) = [p for p in out.iterdir() if p.name.startswith("incident-")]
    return folder


def test_a_rank_that_raises_in_forward_ends_the_whole_job_within_seconds_with_every_window_verified(tmp_path):
    out = tmp_path / "repros"
    code, seconds, text = _run(out, "default", "destroy")
    assert code != 0, text[-3000:]
    assert seconds < BOUND_S, f"{seconds:.1f} s from rank 1's error to torchrun's exit\n{text[-3000:]}"
    folder = _incident(out)
    bundles = sorted(folder.iterdir(), key=lambda b: b.name.rsplit("-", 1)[-1])  # by rank
    assert [b.name.rsplit("-", 1)[-1] for b in bundles] == ["rank0of2", "rank1of2"], bundles
    for b in bundles:
        assert reprokit.verify(b) == [], b
    # rank 1: its own exception, unchanged; rank 0: an error that says who failed, where, and where the windows are
    assert "[rank1]: IndexError: index 99 is out of bounds for dimension 0 with size 16" in text, text[-3000:]
    peer = next(x for x in text.splitlines() if x.startswith("[rank0]: reprokit.errors.PeerFailure"))
    assert "rank 1 failed at step 17 (IndexError in rk_fail_fast.py:forward at step 17" in peer, peer
    assert f"incident: {folder}." in peer and f"`reprokit replay {folder}`" in peer, peer
    assert f"reprokit: rank 0's window: {bundles[0]} (verified)" in text, text[-3000:]
    # the incident replays on two ranks and rank 1's failure reproduces
    r = CliRunner().invoke(cli, ["replay", str(folder), "--nproc", "2", "--json"])
    d = json.loads(r.stdout)
    assert r.exit_code == 1 and d["reproduced"] and d["failing_rank"] == 1, r.output
    assert {x["rank"]: x.get("reproduced") for x in d["ranks"]}[1] is True, d["ranks"]


def test_a_failing_rank_whose_exit_path_waits_in_a_barrier_no_longer_holds_the_job(tmp_path):
    """Gloo cannot abort a blocked call: rank 0, still blocked after both windows are written, ends its own process;
    rank 1's barrier then breaks, and torchrun ends."""
    out = tmp_path / "repros"
    code, seconds, text = _run(out, "abort", "barrier")
    assert code != 0 and seconds < BOUND_S, (code, seconds, text[-3000:])
    assert "reprokit: rank 0 is still blocked in step 17's collective" in text, text[-3000:]
    assert "gloo cannot abort a blocked call, so it ends its process" in text, text[-3000:]
    for b in _incident(out).iterdir():
        assert reprokit.verify(b) == [], b


def test_with_on_incident_wait_a_blocked_rank_still_waits_past_the_abort_path_s_time(tmp_path):
    """Today's behaviour kept: both windows are written, then both ranks wait (rank 0 in its all-reduce, rank 1 in
    its barrier) until the process group's timeout; the test stops it 20 s after the error, twice the time the abort
    path takes here (the default mode ends the same job in about 10 s)."""
    out = tmp_path / "repros"
    proc, log = _start(out, "wait", "barrier")
    try:
        deadline = time.monotonic() + 180
        while (raised := _error_time(log)) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        assert raised is not None, log.read_text()[-3000:]
        while time.time() < raised + 20 and proc.poll() is None:
            time.sleep(0.5)
        assert proc.poll() is None, f"torchrun ended by itself (exit {proc.returncode}):\n{log.read_text()[-3000:]}"
        text = log.read_text(errors="replace")
        assert "PeerFailure" not in text and "ends its process" not in text, text[-3000:]
        assert len([b for b in _incident(out).iterdir() if reprokit.verify(b) == []]) == 2
    finally:
        _stop(proc)


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2),
                    reason="needs two CUDA devices (run on the 2-GPU machine)")
@pytest.mark.parametrize("exit_path", ["destroy", "barrier"])
def test_nccl_a_rank_that_raises_in_forward_ends_the_job_within_seconds(tmp_path, exit_path):
    """NCCL: rank 0's all-reduce is aborted (ProcessGroup.abort), rank 1 aborts its own group before its error is
    raised, so neither its destroy_process_group nor its barrier waits for the watchdog."""
    out = tmp_path / "repros"
    code, seconds, text = _run(out, "default", exit_path, device="cuda")
    print(f"NCCL {exit_path}: {seconds:.1f} s from rank 1's error to torchrun's exit")
    assert code != 0 and seconds < BOUND_S, (code, seconds, text[-4000:])
    assert "reprokit: rank 0 aborted its process group" in text, text[-4000:]
    for b in _incident(out).iterdir():
        assert reprokit.verify(b) == [], b


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie its parent has not reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def _run_killed(out: Path, failure: str, step: int = 17) -> str:
    """torchrun with rank 1 killed at ``step`` (see the tests below); its output once rank 0 has ended."""
    proc, log = _start(out, "default", "destroy", failure=failure, launcher=("--monitor-interval", "600"), step=step)
    try:
        deadline = time.monotonic() + 240
        while "raises PeerFailure" not in log.read_text(errors="replace") and proc.poll() is None and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        text = log.read_text(errors="replace")
        pid0 = int(re.search(r"rank 0 runs as pid (\d+)", text).group(1))  # type: ignore[union-attr]
        end = time.monotonic() + 30
        while not _ended(pid0) and time.monotonic() < end:
            time.sleep(0.2)
        assert _ended(pid0), f"rank 0 (pid {pid0}) still runs\n{text[-3000:]}"
        return log.read_text(errors="replace")
    finally:
        _stop(proc)


def _seconds(text: str) -> float:
    """From rank 1's death to rank 0's PeerFailure (the project prints both times)."""
    killed = float(re.search(r"rank 1 is killed at step \d+ at t=([0-9.]+)", text).group(1))  # type: ignore[union-attr]
    failed = float(re.search(r"rank 0 raises PeerFailure at t=([0-9.]+)", text).group(1))  # type: ignore[union-attr]
    return failed - killed


def test_a_rank_killed_outright_is_found_dead_by_its_peer_which_writes_its_window_and_ends(tmp_path):
    """Rank 1 SIGKILLs itself in its forward at step 17 (durable=True), when the marker is in its batch: no Python
    frame is left to declare an incident. On one host torchrun's agent would SIGTERM rank 0 within 0.1 s of seeing the
    death; here it looks only every 10 minutes (``--monitor-interval``), as the agents of a multi-node job do not see
    a death on another node at all, so what ends rank 0 is reprokit: its watcher finds rank 1's process gone and its
    flight log's lock released, declares the incident for it, writes rank 0's window, and rank 0's step (whose gloo
    all-reduce broke) raises PeerFailure. Then ``reprokit recover`` writes rank 1's window into the same incident
    folder from its flight log, and the incident replays on two ranks: rank 1 dies again at step 17."""
    out = tmp_path / "repros"
    text = _run_killed(out, "kill")
    assert _seconds(text) < BOUND_S, (_seconds(text), text[-3000:])
    folder = _incident(out)
    peer = next(x for x in text.splitlines() if x.startswith("[rank0]: reprokit.errors.PeerFailure"))
    assert "rank 1 failed at step 17 (rank 1's process died during step 17 without a Python error" in peer, peer
    assert f"`reprokit recover {out}`" in peer and f"`reprokit replay {folder}`" in peer, peer
    [mine] = [b for b in folder.iterdir() if b.is_dir()]
    assert mine.name.endswith("-peer-rank0of2") and reprokit.verify(mine) == [], mine
    died = json.loads((folder / "died-rank1.json").read_text())
    assert (died["rank"], died["detected_by"], died["last_started"]) == (1, 0, 17), died
    assert "flight log's lock was released" in died["how"], died

    r = CliRunner().invoke(cli, ["recover", str(out), "--json"])
    assert r.exit_code == 0, r.output
    [run] = json.loads(r.stdout)["runs"]
    assert (run["status"], run["incident"]) == ("recovered", str(folder)), (run, text[-3000:])
    from reprokit.distributed.incident import rank_bundles

    bundles = rank_bundles(folder)  # every rank once, windows starting at one step
    assert (bundles[0].failure.kind, bundles[1].failure.kind, bundles[1].failure.step) == ("peer", "crash", 17)
    assert bundles[1].failure.detail["incident"]["died"]["detected_by"] == 0

    r = CliRunner().invoke(cli, ["replay", str(folder), "--nproc", "2", "--json"])
    d = json.loads(r.stdout)
    assert r.exit_code == 1 and d["reproduced"] and d["failing_rank"] == 1 and d["declared_by"] == 0, r.output
    rank1 = d["ranks"][1]
    assert (rank1["failure"]["kind"], rank1["failure"]["step"], rank1["failure"]["exception_type"]) == (
        "crash", 17, "SIGKILL"), rank1


def test_a_rank_outside_any_collective_when_its_peer_is_killed_writes_its_window_then_stops_at_its_next_step(tmp_path):
    """Rank 0 is loading its next batch (4 s) when rank 1 is killed: no collective of its breaks. Its watcher thread
    alone finds rank 1 dead and writes rank 0's window meanwhile, and rank 0's next step raises PeerFailure before it
    enters a collective that would never complete."""
    out = tmp_path / "repros"
    text = _run_killed(out, "kill-between")
    assert _seconds(text) < BOUND_S, (_seconds(text), text[-3000:])
    folder = _incident(out)
    [mine] = [b for b in folder.iterdir() if b.is_dir()]
    assert f"reprokit: rank 0's window: {mine} (verified)" in text, text[-3000:]
    assert text.index("reprokit: rank 0's window:") < text.index("rank 0 raises PeerFailure"), text[-3000:]
    b = reprokit.open_bundle(mine)
    assert (b.failure.kind, b.failure.step, b.run["window"]["end"]) == ("peer", 17, 16)  # it never started step 17
    peer = next(x for x in text.splitlines() if x.startswith("[rank0]: reprokit.errors.PeerFailure"))
    assert "rank 1 failed at step 17 (rank 1's process died during step 17" in peer, peer
    assert "Connection" not in text.split("rank 0 raises PeerFailure")[1], text[-3000:]  # no collective broke


def test_a_rank_killed_in_the_step_that_took_a_snapshot_is_lined_up_with_its_peer_s_window(tmp_path):
    """Rank 1 dies at step 16, microseconds after it took the snapshot of that step: its writer thread has not yet
    written and committed that snapshot, so its flight log's newest window starts at step 8. Rank 0's window in memory
    starts at 16; it writes its window from its own flight log instead, from step 8, so that ``recover`` can add rank
    1's window to the incident and both start at one step (an incident replays only then)."""
    out = tmp_path / "repros"
    text = _run_killed(out, "kill", step=16)
    assert _seconds(text) < BOUND_S, (_seconds(text), text[-3000:])
    folder = _incident(out)
    r = CliRunner().invoke(cli, ["recover", str(out), "--json"])
    [run] = json.loads(r.stdout)["runs"]
    assert (run["status"], run["incident"]) == ("recovered", str(folder)), (run, text[-3000:])
    from reprokit.distributed.incident import rank_bundles

    bundles = rank_bundles(folder)  # refuses windows that start at different steps
    starts = {r: b.run["window"]["start"] for r, b in bundles.items()}
    assert starts[0] == starts[1] in (8, 16), starts
    assert (bundles[1].failure.kind, bundles[1].failure.step, bundles[0].run["window"]["end"]) == ("crash", 16, 16)
    # Which window rank 0 wrote depends on whether rank 1's snapshot was committed before it died (almost never):
    # from its flight log (starting at 8) or from memory (starting at 16); either way the two line up.
    assert (starts[0] == 8) == ("recovered" in bundles[0].run), bundles[0].run.get("recovered")
