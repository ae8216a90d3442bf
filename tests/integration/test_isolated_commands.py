"""``IsolatedRunner.run_command``: ``python -m reprokit ARGS`` in a process forked from a fork server that imported
torch, run as a fresh process started in the folder would run it (the folder's own code, never the server's), killed
with everything it started at its time limit or when the call is interrupted; and a server safe to fork (one thread,
however many threads torch is told to use). Real processes throughout (Linux: /proc)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from reprokit.isolation import IsolatedRunner

pytestmark = pytest.mark.slow  # the tests fork servers and wait out time limits: 6-18 s


@pytest.fixture(scope="module")
def runner():
    """One runner for the tests that keep its server up (the server's start-up is seconds of torch import): it
    starts its server once, and each test checks that the server is still the first one (``starts == 1``) after its
    own calls. Torch is told it may use four threads, for the one-thread check; the other tests' commands do not
    care. The interrupted-call test kills its server on purpose: it has a runner of its own."""
    with IsolatedRunner({"OMP_NUM_THREADS": "4"}, empty_cwd=True) as shared:
        yield shared

# A folder's own ``reprokit`` (a checkout of reprokit itself, or of a project that vendors it): its ``python -m
# reprokit`` says which copy ran, and with ``sleep`` starts a process of its own that never ends, then never ends.
VENDORED_MAIN = '''\
import pathlib, subprocess, sys, time
print("the folder's own reprokit", sys.argv[1:])
if sys.argv[1:] == ["sleep"]:
    child = subprocess.Popen(["sleep", "600"])
    pathlib.Path("sleeper.pid").write_text(str(child.pid))
    time.sleep(600)
'''


def _vendoring(folder: Path) -> Path:
    (folder / "reprokit").mkdir(parents=True)
    (folder / "reprokit" / "__init__.py").write_text("")
    (folder / "reprokit" / "__main__.py").write_text(VENDORED_MAIN)
    return folder


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process ``pid`` has ended (a zombie counts as ended) within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def _wait_for(path: Path, within_s: float = 60.0) -> int:
    deadline = time.monotonic() + within_s
    while not (path.exists() and path.read_text()):
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return int(path.read_text())


def test_a_folder_holding_its_own_reprokit_runs_that_one_and_a_plain_folder_the_servers(tmp_path, runner):
    """A fresh ``python -m reprokit`` started in a checkout that holds a ``reprokit`` package runs that package (the
    folder is first on sys.path); so must the forked command, though the server has reprokit imported already."""
    vendoring = _vendoring(tmp_path / "vendoring")
    plain = tmp_path / "plain"
    plain.mkdir()
    run = runner.run_command(["--version"], cwd=vendoring, timeout=120)
    assert (run.returncode, run.stdout) == (0, "the folder's own reprokit ['--version']\n"), run
    run = runner.run_command(["--version"], cwd=plain, timeout=120)
    assert run.returncode == 0 and "the folder's own" not in run.stdout and "reprokit" in run.stdout, run
    run = runner.run_command(["--version"], cwd=vendoring, timeout=120)  # nothing of one folder stays
    assert run.stdout.startswith("the folder's own reprokit"), run
    run = runner.run_command(["--version"], cwd=tmp_path / "gone", timeout=120)  # no such folder: said why
    assert run.returncode == 1 and "FileNotFoundError" in run.stderr and "gone" in run.stderr, run
    assert runner.starts == 1


def test_a_command_past_its_time_limit_is_killed_with_every_process_it_started(tmp_path, runner):
    folder = _vendoring(tmp_path / "checkout")
    t0 = time.monotonic()
    run = runner.run_command(["sleep"], cwd=folder, timeout=5)
    assert run.timed_out and time.monotonic() - t0 < 60, run
    assert _gone(_wait_for(folder / "sleeper.pid")), "the command's own child outlived its time limit"
    (folder / "sleeper.pid").unlink()
    assert runner.run_command(["again"], cwd=folder, timeout=120).returncode == 0  # the server goes on
    assert runner.starts == 1


def test_an_interrupted_call_kills_the_command_and_what_it_started(tmp_path):
    """Ctrl-C (here an alarm whose handler raises) while the command runs: the call raises, and neither the command
    nor its child nor the fork server is left running; the next call starts another server."""
    folder = _vendoring(tmp_path / "checkout")

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    with IsolatedRunner(empty_cwd=True) as runner:
        runner.run_command(["warm"], cwd=folder, timeout=120)  # the server is up: the alarm lands in the command
        server = runner._child.proc.pid
        previous = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.alarm(5)
            with pytest.raises(KeyboardInterrupt):
                runner.run_command(["sleep"], cwd=folder, timeout=120)
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)
        sleeper = _wait_for(folder / "sleeper.pid")
        assert _gone(sleeper) and _gone(server), "a process outlived the interrupted call"
        assert runner.run_command(["again"], cwd=folder, timeout=120).returncode == 0
        assert runner.starts == 2


def test_the_fork_server_has_one_thread_after_replays_and_commands(tmp_path, nan_bundle, runner):
    """Forking a process with other threads copies whatever locks they hold (an OpenMP pool's: a child that uses it
    can hang). The server runs no torch op of its own, so torch's pool never starts there, even where it may use four
    threads: after its forks the server has one thread (numpy's OpenBLAS pool, started at import, is shut down by
    OpenBLAS itself before each fork; torch's would stay)."""
    from reprokit.bundle import open_bundle

    b = open_bundle(nan_bundle)
    a = runner.attempt(b.path, recorded=b.failure)
    assert a.outcome is not None and a.outcome.same, a
    run = runner.run_command(["inspect", str(b.path)], cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    threads = os.listdir(f"/proc/{runner._child.proc.pid}/task")
    assert len(threads) == 1, threads
    assert runner.starts == 1  # the server these forks came from is the runner's first (told four threads)
