"""Telling that a peer rank died, without a collective: its flight log's lock, its pid, its heartbeat.

A rank killed outright (SIGKILL, the OOM killer, a segfault in an extension) writes no incident: its peers would wait
in their next collective until the backend's timeout. Under ``Recorder(durable=True)`` every rank's flight folder
(``out_dir/.reprokit-flight/<run id>/rank<k>/``, :mod:`reprokit.flight`) holds what its peers need to tell:

- **A peer on this host** is checked every time the incident watcher polls (0.2 s): its pid (with its start time,
  from ``/proc``, so that a recycled pid is not taken for it) is gone or a zombie, *and* the ``flock`` it held on its
  ``lock`` file for its lifetime has been dropped by the kernel. Both are checks, not guesses: a pid that another
  PID namespace hides still holds its lock, and a lock is never free while the process lives.
- **A peer on another host** cannot be checked that way. Its incident watcher rewrites its ``heartbeat`` file every
  second (pid, step, wall time; no fsync). While this rank waits, inside one step for ``peer_timeout_s`` or more, it
  reads the heartbeats of the peers on other hosts every few seconds: one older than ``peer_timeout_s`` by this
  host's clock, and unchanged since this rank's last read, is a death.

A peer whose flight folder is gone ended its run normally (``Recorder.close()`` removes it); one whose folder does
not exist yet has not attached; neither is ever declared dead.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprokit.flight import HEARTBEAT, LOCK, LOG, OWNER, Beat, read_beat, read_log, start_ticks

PEER_TIMEOUT_S = 300.0
"""The default ``Recorder(peer_timeout_s=...)``: how old a heartbeat of a peer on another host must be (while this
rank waits in one step at least as long) before the peer counts as dead. Generous: a peer whose Python threads are
held for minutes (a long call that keeps the GIL) must not be taken for dead; still well below NCCL's watchdog, which
labs often raise to 30 or 60 minutes."""
BEAT_EVERY_S = 1.0
"""How often a rank's incident watcher rewrites its heartbeat."""
REMOTE_CHECK_EVERY_S = 5.0
"""How often a waiting rank reads the heartbeats of its peers on other hosts."""


@dataclass(frozen=True)
class Death:
    """A peer rank found dead, and how."""

    rank: int
    pid: int | None
    host: str | None
    how: str
    """How it was told (the check that said so), in words."""
    last_started: int | None
    """The last step it started (its flight log, else its heartbeat), or None when neither says."""
    detected_by: int
    seen_at: float

    def what(self) -> str:
        during = f"during step {self.last_started}" if self.last_started is not None else "before its first step"
        return (f"rank {self.rank}'s process died {during} without a Python error (killed outright: SIGKILL, the OOM "
                f"killer, a segfault); rank {self.detected_by} saw {self.how}")

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": self.pid, "host": self.host, "how": self.how,
                "last_started": self.last_started, "detected_by": self.detected_by, "seen_at": self.seen_at}


@dataclass
class _Peer:
    rank: int
    folder: Path
    owner: dict[str, Any] | None = None
    seen: tuple[Beat | None, float] | None = None
    """(the heartbeat at this rank's last read, when it read it): a remote peer is dead only if it did not change."""


class PeerWatch:
    """The flight folders of this rank's peers, checked for deaths (see the module's docstring).

    Example:
        >>> watch = PeerWatch(Path("repros/.reprokit-flight/run-3f9c2a1b"), rank=0, world_size=2)  # doctest: +SKIP
        >>> [d.rank for d in watch.dead(waiting_s=0.0)]                                            # doctest: +SKIP
        [1]
    """

    def __init__(self, run_folder: Path, rank: int, world_size: int, timeout_s: float = PEER_TIMEOUT_S,
                 remote_every_s: float = REMOTE_CHECK_EVERY_S):
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.remote_every_s = float(remote_every_s)
        self.host = socket.gethostname()
        self._peers = [_Peer(r, Path(run_folder) / f"rank{r}") for r in range(world_size) if r != rank]
        self._last_remote = 0.0
        self._lock = threading.Lock()  # the watcher thread and, after a step raised, the training thread
        self.reported: set[int] = set()
        """Ranks already reported dead (each is reported once)."""

    def dead(self, waiting_s: float = 0.0, remote: bool = True) -> list[Death]:
        """Peers found dead now and not reported before. ``waiting_s``: how long this rank has been inside its
        current step (the heartbeats of peers on other hosts are read only once it reaches the timeout);
        ``remote=False``: peers on this host only."""
        with self._lock:
            return self._dead(waiting_s, remote)

    def _dead(self, waiting_s: float, remote: bool) -> list[Death]:
        now = time.monotonic()
        read_remote = remote and waiting_s >= self.timeout_s and now - self._last_remote >= self.remote_every_s
        if read_remote:
            self._last_remote = now
        found = []
        for p in self._peers:
            if p.rank in self.reported:
                continue
            owner = self._owner(p)
            if owner is None:
                continue
            if owner.get("host") == self.host:
                how = self._local_death(p, owner)
            elif read_remote:
                how = self._remote_death(p, now)
            else:
                continue
            if how is not None:
                self.reported.add(p.rank)
                found.append(Death(p.rank, owner.get("pid"), owner.get("host"), how, _last_started(p.folder),
                                   self.rank, time.time()))
        return found

    def _owner(self, p: _Peer) -> dict[str, Any] | None:
        if p.owner is None:
            try:
                doc = json.loads((p.folder / OWNER).read_text())
            except (OSError, ValueError):
                return None  # not attached yet, not durable, or ended normally (its folder removed)
            if isinstance(doc, dict) and isinstance(doc.get("pid"), int):
                p.owner = doc
        return p.owner

    def _local_death(self, p: _Peer, owner: dict[str, Any]) -> str | None:
        pid = int(owner["pid"])
        state = _process_state(pid, int(owner.get("start_ticks") or 0))
        if state == "running":
            return None
        if not _lock_free(p.folder / LOCK):
            return None  # still held: the process lives (in another PID namespace), or a child of it holds it
        gone = "has exited (a zombie its launcher has not reaped yet)" if state == "zombie" else "is gone"
        return f"its process (pid {pid}) {gone} and its flight log's lock was released"

    def _remote_death(self, p: _Peer, now: float) -> str | None:
        if not p.folder.is_dir():
            return None  # ended normally: Recorder.close() removed its folder
        beat = read_beat(p.folder / HEARTBEAT)
        before, p.seen = p.seen, (beat, now)
        if beat is None or before is None or before[0] != beat:
            return None  # no reading yet to compare with, or it changed since: alive
        age = time.time() - beat.time
        if age < self.timeout_s:
            return None
        return (f"its heartbeat (rewritten every {BEAT_EVERY_S:.0f} s while it lives) {age:.0f} s old and unchanged "
                f"for {now - before[1]:.0f} s (peer_timeout_s={self.timeout_s:g}; it ran on {p.owner and p.owner.get('host')})")


def _process_state(pid: int, ticks: int) -> str:
    """``running``, ``zombie`` (exited, not reaped) or ``gone`` (no such process, or the pid now names another one)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return "gone"
    except OSError:
        try:
            os.kill(pid, 0)  # no /proc: ask the kernel whether the pid exists at all
        except ProcessLookupError:
            return "gone"
        except OSError:
            pass
        return "running"
    fields = stat.rsplit(")", 1)[-1].split()
    if fields and fields[0] in ("Z", "X"):
        return "zombie"
    if ticks and start_ticks(pid) not in (0, ticks):
        return "gone"
    return "running"


def _lock_free(path: Path) -> bool:
    """Whether no process holds ``path``'s ``flock`` (taken and given back at once). A missing file is not free: the
    rank removed its folder, ending normally."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    else:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    finally:
        os.close(fd)


def _last_started(folder: Path) -> int | None:
    """The last step a dead rank started: its flight log's newest step record (written before the step ran), else
    its heartbeat's step."""
    wins = sorted(folder.glob("win-*"))
    best = None
    for win in reversed(wins):
        steps = [int(r.header["step"]) for r in read_log(win / LOG).records
                 if r.kind in ("step", "begn") and isinstance(r.header.get("step"), int)]
        if steps:
            best = max(steps)
            break
    beat = read_beat(folder / HEARTBEAT)
    if best is None and beat is not None:
        best = beat.step
    return best
