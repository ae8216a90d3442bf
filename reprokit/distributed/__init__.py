"""Ranks and incidents: every rank of a multi-process run records its own bundle, and a failure on any rank makes
every rank write its window into one incident folder.

Built on ``torch.distributed`` (the process group that torchrun, or the user, initialised): the Recorder reads the
rank, world size, local rank and backend from it. Coordination at failure time needs no collective, since a rank
blocked in one would never answer: the first rank that fails creates an incident file under
``out_dir/.reprokit-incidents/`` (``O_EXCL``: exactly one wins), and a watcher thread on every rank polls for it and
writes that rank's window from host memory, where the snapshot and batches already are. A run's incidents are
numbered (a loop may catch a failure and go on): each rank handles every one once, so all agree on the next.
So ``out_dir`` must be on a filesystem every rank sees (one node, or a shared filesystem).

At attach time rank 0 puts a random run key in the process group's store (no collective) that names this run's
incident files, so a file left by an earlier run is never mistaken for a new incident. A rank other than 0 waits for
rank 0's key: rank 0 must create a Recorder whenever another rank does, as SPMD training loops do.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import itertools
import json
import os
import secrets
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprokit.bundle.layout import INCIDENT_PREFIX, rank_tag
from reprokit.distributed.team import write_first

INCIDENTS_DIR = ".reprokit-incidents"
EXIT_WAIT_S = 300.0
"""How long interpreter exit waits for a window the incident watcher is writing (a large state takes a while)."""


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    run_key: str
    """Shared by every rank of this run (a nonce rank 0 puts in the process group's store at attach time)."""
    restart: int = 0
    """How many times torchrun restarted the workers before this attempt (``TORCHELASTIC_RESTART_COUNT``)."""

    @property
    def tag(self) -> str:
        """``rank01of04``: the part of a bundle folder's name that says which rank wrote it."""
        return rank_tag(self.rank, self.world_size)

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
                "backend": self.backend, "restart": self.restart}


_ATTACHES = itertools.count()
"""Recorders attached in this process: the n-th of every rank shares the n-th run key rank 0 put in the store."""


def rank_info(out_dir: Path | None = None) -> RankInfo | None:
    """This process's place in the default process group, or None when there is none (a single-process run).

    ``out_dir``: rank 0 leaves a mark of this run there, for :func:`sees_rank0`.

    No collective: rank 0 puts a random run key in the process group's store and the other ranks read it, so a
    Recorder on some ranks only (tooling on rank 0 alone) neither hangs nor pairs with the training's collectives.
    A rank other than 0 waits (the store's timeout) for rank 0's Recorder to attach.

    Raises:
        CaptureError: rank 0 attached no Recorder within the store's timeout.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    rank = dist.get_rank()
    name = f"reprokit/run/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_ATTACHES)}"
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        key = f"{secrets.randbits(62):016x}"
        if out_dir is not None:
            try:
                mark = _run_mark(Path(out_dir), key)
                mark.parent.mkdir(parents=True, exist_ok=True)
                mark.write_text("")
            except OSError:
                pass  # the other ranks then say that they do not see it
        store.set(name, key)
    else:
        try:
            store.wait([name])
            key = store.get(name).decode()
        except Exception as e:  # the store's own timeout error (DistStoreError, RuntimeError)
            from reprokit.errors import CaptureError

            raise CaptureError(f"rank {rank}: rank 0 attached no reprokit Recorder within the process group's store "
                               f"timeout ({e}). Rank 0 names every run's incidents: create a Recorder on every rank "
                               "(or on rank 0 too), in the same order.") from None
    return RankInfo(rank, dist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank)), str(dist.get_backend()),
                    key, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))


def world_size() -> int:
    """The size of this process's default process group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def nccl_aborts_on_device_errors(backend: str, environ: Mapping[str, str] | None = None) -> bool:
    """Does NCCL's watchdog end this process on a CUDA error (``backend`` holds ``nccl`` and
    ``TORCH_NCCL_RETHROW_CUDA_ERRORS`` is not off in ``environ``, by default ``os.environ``)? The watchdog then throws
    from its own thread (``terminate called after throwing an instance of 'c10::DistBackendError'``) well before a
    bundle can be written. Off: ``0``, ``false``, ``n`` or ``no`` (any case); unset is on, NCCL's default.

    Example:
        >>> off = {"TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"}
        >>> nccl_aborts_on_device_errors("nccl", {}), nccl_aborts_on_device_errors("nccl", off)
        (True, False)
    """
    value = (os.environ if environ is None else environ).get("TORCH_NCCL_RETHROW_CUDA_ERRORS", "1")
    return "nccl" in backend and value.lower() not in ("0", "false", "no", "n")


def _run_mark(out_dir: Path, run_key: str) -> Path:
    return out_dir / INCIDENTS_DIR / f"{run_key}.run"


def sees_rank0(out_dir: Path, info: RankInfo, wait_s: float = 2.0) -> bool:
    """Whether this rank sees the mark rank 0 left in its ``out_dir`` at attach (:func:`rank_info`): else the ranks
    record into different folders (a per-rank ``out_dir``, or a node-local disk), and no rank would see another's
    incident. Waits up to ``wait_s`` for a shared filesystem to show it."""
    deadline = time.monotonic() + wait_s
    while not _run_mark(Path(out_dir), info.run_key).exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class IncidentBoard:
    """The incident files of one run, and a watcher thread that reports each new incident once.

    A run can have several incidents (a loop that catches a failure, skips the step and goes on): they are numbered
    in the order they happen, every rank handles each one once, so every rank agrees on the number of the next.

    Example:
        >>> board = IncidentBoard(Path("repros"), info)                     # doctest: +SKIP
        >>> incident = board.declare(step=31204, rank=1, what="non-finite loss")  # doctest: +SKIP
    """

    def __init__(self, out_dir: Path, info: RankInfo, poll_s: float = 0.2):
        self.info = info
        self.path = Path(out_dir) / INCIDENTS_DIR / f"{info.run_key}.json"
        """This run's own file name; each incident is a numbered file beside it (:meth:`incident_path`)."""
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.seen: str | None = None
        """The incident this rank has written its window for (by its own failure or the watcher)."""
        self.current: dict[str, Any] | None = None
        """That incident's document (with its ``number``)."""
        self.handled = 0
        """How many incidents this rank has handled: the next one is number ``handled``."""
        self._on_incident: Callable[[dict[str, Any]], None] | None = None

    def incident_path(self, number: int) -> Path:
        return self.path.with_name(f"{self.info.run_key}.{number}.json")

    def declare(self, step: int, rank: int, what: str, died: dict[str, Any] | None = None) -> dict[str, Any]:
        """This rank failed (or found rank ``rank`` dead: ``died`` says how, :mod:`reprokit.distributed.peers`):
        create the next incident (or join it, when another rank created it first) and return it. The incident's name
        carries this run's key, so two runs writing into one ``out_dir`` never share an incident folder."""
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        number = self.handled
        doc = {"incident": f"{INCIDENT_PREFIX}{stamp}-step{step:08d}-{self.info.run_key[:8]}", "step": step, "rank": rank,
               "what": what, "world_size": self.info.world_size, "number": number}
        if died is not None:
            doc["died"] = died
        path = self.incident_path(number)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{rank}.tmp")
        tmp.write_text(json.dumps(doc))
        try:
            os.link(tmp, path)  # atomic and exclusive: the first failing rank's incident wins
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
        return self.read(number) or doc

    def read(self, number: int) -> dict[str, Any] | None:
        try:
            doc = json.loads(self.incident_path(number).read_text())
        except (OSError, ValueError):
            return None
        ok = isinstance(doc, dict) and isinstance(doc.get("incident"), str) and doc.get("number") == number
        return doc if ok else None

    def pending(self) -> dict[str, Any] | None:
        """The next incident, when one is declared that this rank has not handled yet."""
        number = self.handled
        return self.read(number) if self.incident_path(number).exists() else None

    def mark_dead(self, rank: int, death: dict[str, Any]) -> None:
        """Say that ``rank``'s process died (no rank waits for its window any more). The first mark stays."""
        with contextlib.suppress(OSError):
            write_first(self._dead_path(rank), json.dumps(death), self.info.rank)

    def dead(self) -> set[int]:
        """The ranks marked dead (:meth:`mark_dead`)."""
        return {r for r in range(self.info.world_size) if self._dead_path(r).exists()}

    def _dead_path(self, rank: int) -> Path:
        return self.path.with_name(f"{self.info.run_key}.rank{rank}.dead")

    def handle(self, doc: dict[str, Any]) -> None:
        """This rank writes (or has given up writing) its window for incident ``doc``: the next one is the one after."""
        self.seen, self.current = doc["incident"], doc
        self.handled = max(self.handled, int(doc["number"]) + 1)

    def done(self, rank: int) -> None:
        """Mark that ``rank`` has written its window for the current incident (or given up trying)."""
        try:
            self.done_path(rank).write_text(self.seen or "")
        except OSError:
            pass

    def attach(self) -> None:
        """Say that this rank records (a rank without a Recorder, or one whose out_dir is elsewhere, is never
        waited for)."""
        try:
            path = self._attached_path(self.info.rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")
        except OSError:
            pass

    def wait_for_all(self, timeout_s: float) -> list[int]:
        """Wait until every rank that records here marked the current incident done, at most ``timeout_s``; returns
        the ranks still missing."""
        deadline = time.monotonic() + timeout_s
        while True:
            dead = self.dead()
            missing = [r for r in range(self.info.world_size) if not self.done_path(r).exists() and r not in dead and (
                r == self.info.rank or self._attached_path(r).exists())]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(min(self.poll_s / 2, 0.05))

    def mark_outcome(self, rank: int, outcome: str) -> None:
        """Say how ``rank`` ends the current incident: ``failed`` (it raises its own failure; a loop that catches it
        may go on) or ``abort`` (it did not fail itself and ends its part of the run; see
        :mod:`reprokit.distributed.abort`)."""
        try:
            self.done_path(rank).with_suffix(".outcome").write_text(outcome)
        except OSError:
            pass

    def outcome(self, rank: int) -> str | None:
        """What :meth:`mark_outcome` said for ``rank`` in the current incident, or None when it has not yet."""
        try:
            return self.done_path(rank).with_suffix(".outcome").read_text() or None
        except OSError:
            return None

    def recording_ranks(self) -> list[int]:
        """The ranks that record here (attached, not dead), this one included."""
        dead = self.dead()
        return [r for r in range(self.info.world_size) if r == self.info.rank or (
            self._attached_path(r).exists() and r not in dead)]

    def _attached_path(self, rank: int) -> Path:
        return self.path.with_name(f"{self.info.run_key}.rank{rank}.attached")

    def done_path(self, rank: int) -> Path:
        """``rank``'s mark of the current incident (the last one this rank handled)."""
        number = int(self.current["number"]) if self.current else 0
        return self.path.with_name(f"{self.info.run_key}.{number}.rank{rank}.done")

    def watch(self, on_incident: Callable[[dict[str, Any]], None], tick: Callable[[], None] | None = None) -> None:
        """Call ``on_incident(doc)`` from a daemon thread when an incident this rank has not written appears; ``tick()``
        before each look (the recorder's heartbeat and its check of the peers, :mod:`reprokit.distributed.peers`).

        At interpreter exit (a script that ends without closing its Recorder) the watcher is not cut off: the window
        it is writing is finished, and an incident that appeared since its last poll is written from the exiting
        thread (:meth:`finish`), so a peer that failed in the last steps still gets this rank's window.
        """
        self._on_incident = on_incident

        def loop() -> None:
            while not self._stop.wait(self.poll_s):
                if tick is not None:
                    try:
                        tick()
                    except Exception:  # never let the watcher die loudly inside a training job
                        pass
                self._poll()

        self._thread = threading.Thread(target=loop, name="reprokit-incidents", daemon=True)
        self._thread.start()
        _watching.add(self)
        global _exit_hook
        if not _exit_hook:
            atexit.register(_finish_all)
            _exit_hook = True

    def _poll(self) -> None:
        number = self.handled
        doc = self.read(number) if self.incident_path(number).exists() else None
        if doc is not None and doc["incident"] != self.seen and self._on_incident is not None:
            try:
                self._on_incident(doc)
            except Exception:  # never let the watcher die loudly inside a training job
                self.handle(doc)
                self.done(self.info.rank)

    def close(self) -> None:
        """Stop watching (the Recorder's ``close``): a window the watcher is writing is finished (at most
        ``EXIT_WAIT_S``); an incident that appears later is not written."""
        _watching.discard(self)
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            self._join(thread)

    def finish(self, timeout_s: float = EXIT_WAIT_S) -> None:
        """At interpreter exit: let the watcher finish the window it is writing (at most ``timeout_s``), then write
        this rank's window for an incident it has not seen yet. Never raises."""
        _watching.discard(self)
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and not self._join(thread, timeout_s):
            return  # still writing: leave it, rather than a second writer
        try:
            self._poll()
        except Exception:
            pass

    def _join(self, thread: threading.Thread, timeout_s: float = EXIT_WAIT_S) -> bool:
        """Wait for the watcher thread; one that is still writing a window after a second is said on stderr (the
        wait is not silent). False if it is still running after ``timeout_s``."""
        thread.join(timeout=min(1.0, timeout_s))
        if thread.is_alive():
            print(f"reprokit: rank {self.info.rank} is writing its window of incident {self.seen or '(new)'}; waiting "
                  f"up to {timeout_s:.0f} s before exiting", file=sys.stderr, flush=True)
            thread.join(timeout=max(0.0, timeout_s - 1.0))
        return not thread.is_alive()


_watching: weakref.WeakSet[IncidentBoard] = weakref.WeakSet()
"""Boards whose watcher runs (not closed)."""
_exit_hook = False


def _finish_all() -> None:
    """atexit: every watching board finishes (:meth:`IncidentBoard.finish`) before the interpreter tears down, where
    a daemon thread in the middle of writing would be cut off (and one inside torch's C++ code would abort it)."""
    for board in list(_watching):
        board.finish()
