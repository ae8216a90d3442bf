"""Telling a dead peer rank from a live one through its flight folder (``reprokit.distributed.peers``): real
processes holding real ``flock`` locks, killed with real signals; real heartbeat and log files."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from reprokit.distributed.peers import PeerWatch
from reprokit.flight import HEARTBEAT, LOCK, LOG, OWNER, encode_beat, encode_record, read_beat, start_ticks

ROOT = Path(__file__).resolve().parents[2]

HOLD = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("locked", flush=True)
    time.sleep(120)
""")


def _rank_folder(run: Path, rank: int, pid: int, host: str | None = None) -> Path:
    folder = run / f"rank{rank}"
    folder.mkdir(parents=True)
    (folder / LOCK).touch()
    (folder / OWNER).write_text(json.dumps({"pid": pid, "start_ticks": start_ticks(pid), "rank": rank,
                                            "host": host or socket.gethostname()}))
    return folder


def _holder(lock: Path) -> subprocess.Popen:
    """A real process that holds ``lock``'s flock until it dies."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def test_a_peer_on_this_host_is_dead_once_killed_even_before_its_parent_reaps_it(tmp_path):
    run = tmp_path / "run-x"
    lock = run / "rank1" / LOCK
    lock.parent.mkdir(parents=True)
    proc = _holder(lock)
    try:
        (lock.parent / OWNER).write_text(json.dumps({"pid": proc.pid, "start_ticks": start_ticks(proc.pid),
                                                     "host": socket.gethostname()}))
        win = lock.parent / "win-00000008"
        win.mkdir()
        (win / LOG).write_bytes(b"".join(encode_record(b"step", {"step": k, "batch": None, "rng": {}}) for k in (8, 9)))
        watch = PeerWatch(run, rank=0, world_size=2)
        assert watch.dead() == []
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        found = []
        while not found and time.monotonic() < deadline:  # not reaped: a zombie until proc.wait()
            found = watch.dead()
            time.sleep(0.02)
        [death] = found
        assert (death.rank, death.pid, death.detected_by, death.last_started) == (1, proc.pid, 0, 9)
        assert "zombie" in death.how and "lock was released" in death.how, death.how
        assert "rank 1's process died during step 9" in death.what()
        assert watch.dead() == []  # reported once
    finally:
        _end(proc)
    [death] = PeerWatch(run, rank=0, world_size=2).dead()
    assert f"(pid {proc.pid}) is gone" in death.how


def test_a_peer_whose_pid_is_gone_but_whose_lock_is_held_is_alive(tmp_path):
    """A pid this host cannot see (another PID namespace), or a child of the rank still holding its lock: the lock is
    the check, so it is never declared dead."""
    run = tmp_path / "run-x"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    folder = _rank_folder(run, 1, gone.pid)
    proc = _holder(folder / LOCK)
    try:
        assert PeerWatch(run, rank=0, world_size=2).dead() == []
    finally:
        _end(proc)
    assert [d.rank for d in PeerWatch(run, rank=0, world_size=2).dead()] == [1]


def test_a_peer_that_ended_normally_or_never_attached_is_not_dead(tmp_path):
    run = tmp_path / "run-x"
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    folder = _rank_folder(run, 1, gone.pid)
    (folder / LOCK).unlink()  # Recorder.close() removes the folder: the lock file goes with it
    assert PeerWatch(run, rank=0, world_size=3).dead() == []  # rank 2 never made a folder


def test_a_peer_on_another_host_is_dead_once_its_heartbeat_is_older_than_the_timeout_while_this_rank_waits(tmp_path):
    run = tmp_path / "run-x"
    old = _rank_folder(run, 1, 4242, host="another-host")
    fresh = _rank_folder(run, 2, 4343, host="another-host")
    (old / HEARTBEAT).write_bytes(encode_beat(7, 31, time.time() - 100, 4242))
    (fresh / HEARTBEAT).write_bytes(encode_beat(7, 31, time.time() - 100, 4343))
    watch = PeerWatch(run, rank=0, world_size=3, timeout_s=30, remote_every_s=0)
    assert watch.dead(waiting_s=10) == []  # this rank has not waited as long as the timeout: nothing is read
    assert watch.dead(waiting_s=30) == []  # a first reading: nothing to compare with yet
    (fresh / HEARTBEAT).write_bytes(encode_beat(8, 32, time.time(), 4343))  # rank 2 beats again
    [death] = watch.dead(waiting_s=31)
    assert (death.rank, death.host, death.last_started) == (1, "another-host", 31)
    assert "heartbeat" in death.how and "peer_timeout_s=30" in death.how, death.how
    assert watch.dead(waiting_s=40) == []  # rank 2 changed since the last read: alive


def test_a_torn_heartbeat_is_not_read_as_one(tmp_path):
    path = tmp_path / HEARTBEAT
    data = encode_beat(3, 17, 1234.5, 99)
    path.write_bytes(data)
    beat = read_beat(path)
    assert beat is not None and (beat.seq, beat.step, beat.time, beat.pid) == (3, 17, 1234.5, 99)
    path.write_bytes(data[:20] + encode_beat(4, 18, 1240.0, 99)[20:])  # half of one write, half of the next
    assert read_beat(path) is None
    path.write_bytes(data[:-1])
    assert read_beat(path) is None


FORKS = textwrap.dedent("""
    import os, signal, sys, time
    from pathlib import Path
    from reprokit.flight import FlightLog
    log = FlightLog.start(Path(sys.argv[1]), "run-x", 1, {"rank": 1, "world_size": 2}, {}, {}, [], print)
    if os.fork() == 0:  # a DataLoader worker, say: it outlives the rank for a while
        time.sleep(60)
        os._exit(0)
    print("ready", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs os.register_at_fork")
def test_a_process_forked_from_a_rank_does_not_keep_its_lock_once_the_rank_is_killed(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-c", FORKS, str(out)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        assert proc.wait(60) == -signal.SIGKILL
        run = out / ".reprokit-flight" / "run-x"
        [death] = PeerWatch(run, rank=0, world_size=2).dead()
        assert death.rank == 1 and "lock was released" in death.how
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the forked child, still sleeping
        _end(proc)
