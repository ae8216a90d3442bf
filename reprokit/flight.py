"""The flight log: the recorder's window written behind to disk, so that a process that dies leaves it behind.

``Recorder(durable=True)`` keeps what it records in memory as always and also writes it under
``out_dir/.reprokit-flight/<run id>/rank<k>/``, from the host copies it already makes:

- ``owner.json``: pid (and its start time in clock ticks, from /proc), host, start time, run id, rank; ``lock``: an
  ``fcntl.flock`` held for the process's lifetime (the kernel drops it on any death, so ``reprokit recover`` and the
  peers' watchers tell a dead rank from a live one without guessing from pids; a process forked from the rank, a
  DataLoader worker, closes its copy at once); ``heartbeat``: pid, the step the recorder is at and the wall time,
  rewritten in place every second by the rank's incident watcher thread (never by the training thread, never
  fsynced), so that peers on other hosts can tell a rank that stopped (:mod:`reprokit.distributed.peers`);
  ``faults.log`` (``faulthandler``: SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) and
  ``sigterm.log`` (a SIGTERM, when the process had no handler of its own for it).
- ``run.json``, ``env.json`` and ``code/``: what a bundle needs that does not change during the run, written once.
- ``win-<step>/``: one folder per window: the snapshot's tensor files, and ``log``, an append-only file of
  self-checking records (below): each step's batch and RNG state (``step``), a step that finished (``end``),
  the snapshot's commit (``snap``, written last, after its files are fsynced), a window the recorder dropped
  (``drop``), a bundle the recorder wrote (``bndl``), an interpreter exit inside a step (``exit``).

A record is ``MAGIC | kind (4 bytes) | json length (u32) | payload length (u64) | payload | sha256``, the payload a
JSON header followed by the tensors as safetensors bytes (never pickle), the digest over everything before it. A
record torn by a death (a short write, a page never written) fails its length or digest check and ends the log:
the reader keeps the longest prefix of whole records and says what it dropped.

When the batch is on the CPU its record is written before the step function runs, with one ``os.writev`` of the
record's buffers straight from the batch's host copy (the page cache survives a process death; no fsync on the
step path). A record's header is compact JSON from the C encoder; its tensors are never copied into a record-sized
buffer first. A CUDA batch reaches host memory only after the step's kernels (the recorder's copy is asynchronous):
a small ``begn`` record says the step started, and a writer thread writes the batch once the copy's event has
completed. That thread frames the record (its Python work) while the device still runs the step, and only hashes
and writes it (both release the GIL) once the copy has landed, when the training thread wants the GIL back to start
the next step. A death before that loses at most that step's batch
(and a step still queued behind a snapshot being written, or the step before, when the death comes before the
writer thread got to its landed copy). Snapshots are written by the same thread once their
copies have landed; at a snapshot's commit the log and folder are fsynced (a host crash keeps what came before),
and windows older than the committed one are deleted: at most two windows are on disk, the last complete one and
the one being written (under a process group one more complete window is kept: the ranks' windows must start at a
snapshot every rank committed, and one rank's commit can lag another's).

Faults of the log itself (a full disk, a read-only folder) warn once and turn durability off; they never raise
into the training loop.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import faulthandler
import fcntl
import hashlib
import json
import os
import queue
import secrets
import shutil
import signal
import socket
import struct
import sys
import threading
import time
import weakref
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FLIGHT_DIR = ".reprokit-flight"
MAGIC = b"RKFLIGHT"
_HEAD = struct.Struct("<8s4sIQ")
DIGEST = 32
MAX_JSON = 64 << 20
"""Most bytes a record's JSON header may take (a reader refuses more: a length field torn into garbage)."""
KINDS = (b"step", b"begn", b"end ", b"snap", b"drop", b"bndl", b"exit")
LOCK = "lock"
OWNER = "owner.json"
RUN = "run.json"
ENV = "env.json"
CODE = "code"
FAULTS = "faults.log"
SIGTERM_LOG = "sigterm.log"
LOG = "log"
HEARTBEAT = "heartbeat"
_BEAT = struct.Struct("<8sQqdqI")
"""magic, sequence number, step, wall time, pid, crc32 of what comes before it."""
BEAT_MAGIC = b"RKBEAT01"
_IOV_MAX = 512
"""Buffers per ``os.writev`` call (the kernel takes at most ``IOV_MAX``, 1024 on Linux)."""
SETTLE_WAIT_S = 600.0
"""How long the training thread waits, at most, for the writer to finish with a buffer it is about to reuse."""


def window_dir(step: int) -> str:
    return f"win-{step:08d}"


def run_id(rank_key: str | None) -> str:
    """The flight folder's run id: under torchrun every rank's Recorder gets rank 0's run key (from the process
    group's store, :func:`reprokit.distributed.rank_info`), so the ranks of one job share it; a single process
    gets a fresh one (time, pid and a nonce: two runs into one out_dir never share a folder)."""
    if rank_key:
        return f"run-{rank_key}"
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return f"run-{stamp}-{os.getpid()}-{secrets.token_hex(4)}"


# --- the heartbeat ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Beat:
    """One heartbeat as read back (:func:`read_beat`)."""

    seq: int
    step: int
    """The step the recorder was at (the last one started, or the next one when between steps)."""
    time: float
    """Wall time (``time.time()`` of the writing host) when it was written."""
    pid: int


def encode_beat(seq: int, step: int, when: float, pid: int) -> bytes:
    head = _BEAT.pack(BEAT_MAGIC, seq, step, when, pid, 0)[:-4]
    return head + struct.pack("<I", zlib.crc32(head))


def read_beat(path: Path) -> Beat | None:
    """The heartbeat at ``path``, or None when there is none or it does not check (torn by a concurrent write: read
    again later)."""
    try:
        with open(path, "rb") as f:
            data = f.read(_BEAT.size)
    except OSError:
        return None
    if len(data) != _BEAT.size:
        return None
    magic, seq, step, when, pid, crc = _BEAT.unpack(data)
    if magic != BEAT_MAGIC or crc != zlib.crc32(data[:-4]):
        return None
    return Beat(seq, step, when, pid)


def start_ticks(pid: int) -> int:
    """When ``pid`` started (clock ticks after boot, /proc), 0 where /proc does not say: with the pid, it names one
    process (a recycled pid has another start)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


# --- records ---------------------------------------------------------------------------------------------------

def record_parts(kind: bytes, header: dict[str, Any], tensors: dict[str, Any] | None = None) -> list[Any]:
    """One self-checking record (see the module's docstring) as the buffers it is written from: the framing, the
    JSON header, the tensors as safetensors straight from their own memory (no copy: ``os.writev`` writes them),
    and the sha256 over all of it. Tensors must not change until the buffers are written."""
    return _seal(_frame(kind, header, tensors))


def _frame(kind: bytes, header: dict[str, Any], tensors: dict[str, Any] | None) -> list[Any]:
    """A record without its digest: everything but reading the tensors' bytes, so it can be done before they are
    filled (a CUDA batch's copy still in flight)."""
    head = _header_json(header)
    body: list[Any] = []
    if tensors:
        from reprokit.bundle.tensorfile import safetensors_parts

        body = safetensors_parts(tensors)
    top = _HEAD.pack(MAGIC, kind, len(head), len(head) + sum(len(b) for b in body))
    return [top, head, *body]


def _seal(parts: list[Any]) -> list[Any]:
    """``parts`` and the sha256 over them (hashlib releases the GIL for all but small pieces)."""
    h = hashlib.sha256()
    for b in parts:
        h.update(b)
    return [*parts, h.digest()]


def encode_record(kind: bytes, header: dict[str, Any], tensors: dict[str, Any] | None = None) -> bytes:
    """One self-checking record as bytes (see :func:`record_parts`)."""
    return b"".join(record_parts(kind, header, tensors))


def _header_json(header: dict[str, Any]) -> bytes:
    """A record's header as compact JSON by the C encoder (a step's header is written on the step path); a value
    that strict JSON cannot hold as it is (a non-finite float, a key that is not a string) goes through the
    bundle's own encoder, which spells it out."""
    try:
        return json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError):
        from reprokit.bundle import dumps

        return dumps(header)


@dataclass
class Record:
    kind: str
    header: dict[str, Any]
    body: bytes
    """safetensors bytes (empty when the record holds no tensors)."""

    def tensors(self) -> dict[str, Any]:
        if not self.body:
            return {}
        from safetensors.torch import load

        return load(self.body)


@dataclass
class LogRead:
    records: list[Record] = field(default_factory=list)
    dropped: str | None = None
    """What the reader could not use at the end of the log (a torn record), or None."""


def read_log(path: Path) -> LogRead:
    """The longest prefix of whole, self-consistent records of the log at ``path``; a torn or damaged record ends it
    (its offset and why are in ``dropped``). Never unpickles anything: headers are JSON, tensors safetensors."""
    out = LogRead()
    try:
        data = path.read_bytes()
    except OSError as e:
        out.dropped = f"{path}: unreadable ({e.strerror or e})"
        return out
    at = 0
    while at < len(data):
        why = None
        if len(data) - at < _HEAD.size + DIGEST:
            why = f"a record cut short ({len(data) - at} bytes)"
        else:
            magic, kind, jlen, plen = _HEAD.unpack_from(data, at)
            end = at + _HEAD.size + plen + DIGEST
            if magic != MAGIC or kind not in KINDS:
                why = "not a record (bad magic or kind)"
            elif jlen > min(plen, MAX_JSON):
                why = "a damaged length field"
            elif end > len(data):
                why = f"a record cut short (needs {end - at} bytes, {len(data) - at} written)"
            elif hashlib.sha256(data[at:end - DIGEST]).digest() != data[end - DIGEST:end]:
                why = "a record whose sha256 does not match (torn or damaged)"
            else:
                start = at + _HEAD.size
                try:
                    header = json.loads(data[start:start + jlen])
                except ValueError:
                    header = None
                if not isinstance(header, dict):
                    why = "a record whose header is not a JSON object"
                else:
                    out.records.append(Record(kind.decode().strip(), header, data[start + jlen:end - DIGEST]))
                    at = end
                    continue
        out.dropped = f"{path.parent.name}/{path.name}: the last {len(data) - at} bytes at offset {at}: {why}"
        break
    return out


# --- the faulthandler, shared by the flight logs of this process ------------------------------------------------

_fault_stack: list[tuple[Any, Any]] = []
"""(faults file, sigterm file or None) of each live flight log, newest last: faulthandler writes to the newest."""
_fault_before: dict[str, Any] = {}
_fault_lock = threading.Lock()


def _faults_on(faults: Any, term: Any) -> Any:
    """Point ``faulthandler`` (and a SIGTERM dump, where nothing else handles SIGTERM) at this flight log's files.
    Returns the SIGTERM file actually registered (None when SIGTERM has a handler of its own)."""
    with _fault_lock:
        if not _fault_stack:
            _fault_before["enabled"] = faulthandler.is_enabled()
        faulthandler.enable(file=faults, all_threads=True)
        if term is not None and (not _fault_stack or _fault_stack[-1][1] is None):
            if threading.current_thread() is not threading.main_thread() or \
                    signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
                term = None  # the user's (or a framework's) own SIGTERM handler stays as it is
        if term is not None:
            # chain: after the dump, the default action (the process ends with SIGTERM as before)
            faulthandler.register(signal.SIGTERM, file=term, all_threads=True, chain=True)
        _fault_stack.append((faults, term))
        return term


def _faults_off(faults: Any) -> None:
    """This flight log closes: faulthandler goes back to the previous live log's file, else to how it was before."""
    with _fault_lock:
        top = bool(_fault_stack) and _fault_stack[-1][0] is faults
        entry = next((e for e in _fault_stack if e[0] is faults), None)
        if entry is None:
            return
        _fault_stack.remove(entry)
        if entry[1] is not None:
            with contextlib.suppress(Exception):
                faulthandler.unregister(signal.SIGTERM)
        if not top:
            return
        if _fault_stack:
            faulthandler.enable(file=_fault_stack[-1][0], all_threads=True)
            if _fault_stack[-1][1] is not None:
                faulthandler.register(signal.SIGTERM, file=_fault_stack[-1][1], all_threads=True, chain=True)
        elif _fault_before.get("enabled"):
            # Enabled before (``python -X faulthandler``, pytest): its file cannot be read back; stderr is its default.
            with contextlib.suppress(Exception):
                faulthandler.enable(file=sys.__stderr__ or 2, all_threads=True)
        else:
            faulthandler.disable()


# --- the writer ---------------------------------------------------------------------------------------------------

_live: weakref.WeakSet[FlightLog] = weakref.WeakSet()
_exit_hook = False
_fork_hook = False


def _after_fork_in_child() -> None:
    """A process forked from a recording one (a DataLoader worker, ``multiprocessing``) closes its copies of the
    flight logs' lock and heartbeat descriptors: a ``flock`` lives as long as any copy of its descriptor, so a worker
    that outlived a killed rank would otherwise keep that rank looking alive. The parent's lock is untouched."""
    for log in list(_live):
        for fd in (log._lock_fd, log._beat_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        log._lock_fd = log._beat_fd = None
        log.on = False
        log._thread = None
        _live.discard(log)


def _at_exit() -> None:
    """Interpreter exit (not a death: atexit runs for a normal end, an uncaught exception, ``sys.exit``): a log whose
    recorder is not inside a step is removed (the run ended; a failure in a step already has its bundle), one whose
    recorder is inside a step says so (``exit``) and stays for ``reprokit recover``."""
    for log in list(_live):
        with contextlib.suppress(Exception):
            log.at_exit()


class FlightLog:
    """The flight log of one Recorder (one rank). Made by :meth:`start`; every method is safe to call from the
    training loop: faults warn (``warn``) and turn the log off."""

    def __init__(self, folder: Path, warn: Callable[[str], None]):
        self.folder = folder
        self.run_folder = folder.parent
        self.warn = warn
        self.on = True
        self.in_step: Callable[[], bool] = lambda: False
        self._lock_fd: int | None = None
        self._beat_fd: int | None = None
        self._beat_seq = 0
        self._faults: Any = None
        self._term: Any = None
        self._write_lock = threading.Lock()
        self._log_fd: int | None = None
        self._window: int | None = None
        self._windows: list[int] = []
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._queued = 0
        self._done = 0
        self._at: dict[int, int] = {}
        """Per batch-buffer position in the window: the sequence number of the last queued record that reads it."""
        self._snap_seq = 0
        self.keep = 1
        """Complete windows kept on disk: 1, or 2 under a process group (the ranks' windows must start at one snapshot
        that every rank committed, and one rank's commit can lag another's)."""
        self._complete: list[int] = []
        self.stats: dict[str, Any] = {"bytes": 0, "records": 0, "seconds": 0.0, "fsyncs": 0}

    # --- lifecycle ---

    @classmethod
    def start(cls, out_dir: Path, rid: str, rank: int | None, owner: dict[str, Any], run: dict[str, Any],
              env: dict[str, Any], code: list[tuple[str, Path]], warn: Callable[[str], None]) -> FlightLog | None:
        """Create the rank folder, take its lock, point faulthandler at it and write what does not change.
        Returns None (after a warning) when that cannot be done: the run goes on without durability."""
        folder = Path(out_dir) / FLIGHT_DIR / rid / f"rank{rank if rank is not None else 0}"
        log = cls(folder, warn)
        if (owner.get("world_size") or 1) > 1:
            log.keep = 2
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder / LOCK, os.O_CREAT | os.O_RDWR, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise OSError(f"{folder / LOCK} is locked by another live process (two Recorders with one run "
                              "id)") from None
            log._lock_fd = fd
            log._beat_fd = os.open(folder / HEARTBEAT, os.O_CREAT | os.O_WRONLY, 0o644)
            log.beat(0)
            _atomic_json(folder / OWNER, {**owner, "pid": os.getpid(), "start_ticks": start_ticks(os.getpid()),
                                          "host": socket.gethostname(), "started": time.time(), "run_id": rid})
            _atomic_json(folder / RUN, run)
            _atomic_json(folder / ENV, env)
            for rel, src in code:
                dst = folder / CODE / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dst)
            log._faults = open(folder / FAULTS, "ab")  # noqa: SIM115 - open for the process's lifetime
            term = open(folder / SIGTERM_LOG, "ab")  # noqa: SIM115
            log._term = _faults_on(log._faults, term)
            if log._term is None:
                term.close()
        except Exception as e:
            log._fail(f"cannot start the flight log in {folder} ({e!r})")
            log.close(remove=True)
            return None
        log._thread = threading.Thread(target=log._run, name="reprokit-flight", daemon=True)
        log._thread.start()
        _live.add(log)
        global _exit_hook, _fork_hook
        if not _exit_hook:
            atexit.register(_at_exit)
            _exit_hook = True
        if not _fork_hook and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_fork_in_child)
            _fork_hook = True
        return log

    def close(self, remove: bool = True) -> None:
        """Stop the writer, give faulthandler back, drop the lock; with ``remove`` the run's flight folder goes."""
        _live.discard(self)
        self.on = False
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout=SETTLE_WAIT_S)
        with self._write_lock:
            if self._log_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._log_fd)
                self._log_fd = None
        if self._faults is not None:
            _faults_off(self._faults)
            for f in (self._faults, self._term):
                if f is not None:
                    with contextlib.suppress(Exception):
                        f.close()
            self._faults = self._term = None
        if self._beat_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._beat_fd)
            self._beat_fd = None
        if remove:
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.run_folder.rmdir()  # the last rank out removes the run's folder
            with contextlib.suppress(OSError):
                self.run_folder.parent.rmdir()
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    def at_exit(self) -> None:
        if self.in_step():
            self.record(b"exit", {"why": "the interpreter exited during a step (sys.exit, or an uncaught "
                                         "exception that was not an Exception)"})
            self.close(remove=False)
        else:
            self.close(remove=True)

    def _fail(self, why: str) -> None:
        """A fault of ours: say so once and stop writing (what is on disk stays readable up to here)."""
        if self.on or self._lock_fd is None:
            self.on = False
            self.warn(f"reprokit: durable recording is off from here on: {why}. Training goes on; a hard crash now "
                      "leaves only what was written before.")

    def beat(self, step: int) -> None:
        """Rewrite the heartbeat in place (one ``pwrite`` of a few dozen bytes, no fsync): the incident watcher's
        thread calls this every second, also while the log itself is off after a fault (the rank is alive)."""
        fd = self._beat_fd
        if fd is None:
            return
        self._beat_seq += 1
        with contextlib.suppress(OSError):
            os.pwrite(fd, encode_beat(self._beat_seq, step, time.time(), os.getpid()), 0)

    # --- the training thread's side ---

    def new_window(self, step: int, tree: dict[str, Any], tensors: Any, landed: Callable[[], bool] | None) -> None:
        """A snapshot was taken at ``step`` (``tensors``: host tensors, filled once ``landed()``; or the spilled
        files): from now on steps go to a new window folder; the writer writes the snapshot's files and commits it."""
        if not self.on:
            return
        try:
            with self._write_lock:
                (self.folder / window_dir(step)).mkdir(exist_ok=True)
                fd = os.open(self.folder / window_dir(step) / LOG, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)
                if self._log_fd is not None:
                    os.close(self._log_fd)
                self._log_fd, self._window = fd, step
                self._windows.append(step)
                self._at.clear()
        except OSError as e:
            self._fail(f"cannot start window {step} ({e.strerror or e})")
            return
        self._snap_seq = self._enqueue(("snap", step, tree, tensors, landed))

    def settle(self) -> None:
        """Before the snapshot engine reuses its host buffers: the last snapshot must be written (it is, long since,
        unless the disk is slower than a whole window of training)."""
        self._wait_for(self._snap_seq)

    def reserve(self, position: int) -> None:
        """Before the batch buffers of ``position`` in the window are written again: the record that reads them
        (one window ago) must be written."""
        seq = self._at.get(position)
        if seq is not None:
            self._wait_for(seq)

    def step(self, step: int, batch: Any, tensors: dict[str, Any], rng: Any) -> None:
        """Step ``step`` starts with this batch (host buffers, filled) and RNG state: written now, before it runs."""
        if not self.on:
            return
        try:
            data = self._step_record(step, batch, tensors, rng)
        except Exception as e:
            self._fail(f"cannot encode step {step}'s record ({e!r})")
            return
        self._write(data)

    def step_later(self, step: int, position: int, batch: Any, tensors: dict[str, Any], rng: Any,
                   events: list[Any]) -> None:
        """Step ``step``'s batch reaches its host buffers once every event in ``events`` has completed (a CUDA copy):
        the writer thread writes its record then (the step's ``begn`` record was written at its start)."""
        if self.on:
            self._at[position] = self._enqueue(("step", step, batch, tensors, rng, events))

    def record(self, kind: bytes, header: dict[str, Any]) -> None:
        """A small record (no tensors), written now: ``end``, ``drop``, ``bndl``, ``exit``."""
        if self.on:
            try:
                self._write(record_parts(kind, header))
            except Exception as e:
                self._fail(f"cannot write a {kind.decode().strip()} record ({e!r})")

    # --- internals ---

    def _step_record(self, step: int, batch: Any, tensors: dict[str, Any], rng: Any) -> list[Any]:
        return _seal(self._step_frame(step, batch, tensors, rng))

    def _step_frame(self, step: int, batch: Any, tensors: dict[str, Any], rng: Any) -> list[Any]:
        from reprokit.rng import encode as encode_rng

        rng_tree, rng_tensors = encode_rng(rng)
        return _frame(b"step", {"step": step, "batch": batch, "rng": rng_tree}, {**tensors, **rng_tensors})

    def _write(self, parts: list[Any]) -> None:
        """Append one record (its buffers, :func:`record_parts`) whole: the lock keeps another thread's record from
        landing inside it."""
        t0 = time.perf_counter()
        try:
            with self._write_lock:
                fd = self._log_fd
                if fd is None:
                    return
                size = _writev_all(fd, parts)
        except OSError as e:
            self._fail(f"cannot write the flight log ({e.strerror or e})")
            return
        self.stats["bytes"] += size
        self.stats["records"] += 1
        self.stats["seconds"] += time.perf_counter() - t0

    def _enqueue(self, item: Any) -> int:
        with self._cond:
            self._queued += 1
            seq = self._queued
        self._queue.put((seq, item))
        return seq

    def _wait_for(self, seq: int) -> None:
        if not seq or self._thread is None:
            return
        with self._cond:
            if self._done < seq:
                self._cond.wait_for(lambda: self._done >= seq or self._thread is None, timeout=SETTLE_WAIT_S)

    def _run(self) -> None:
        while True:
            got = self._queue.get()
            if got is None:
                return
            seq, item = got
            try:
                if self.on:
                    if item[0] == "snap":
                        self._write_snapshot(*item[1:])
                    else:
                        self._write_async_step(*item[1:])
            except Exception as e:
                self._fail(f"the flight writer failed ({e!r})")
            finally:
                with self._cond:
                    self._done = seq
                    self._cond.notify_all()

    def _write_async_step(self, step: int, batch: Any, tensors: dict[str, Any], rng: Any, events: list[Any]) -> None:
        # The record's Python work first, while the device still runs the step (the training thread is then
        # launching it or waiting for it, GIL released), not once its copy has landed, which is when the training
        # thread wants the GIL back to start the next step.
        parts = self._step_frame(step, batch, tensors, rng)
        for e in events:
            e.synchronize()  # this thread only: the training thread never waits here
        self._write(_seal(parts))

    def _write_snapshot(self, step: int, tree: dict[str, Any], tensors: Any, landed: Callable[[], bool] | None) -> None:
        from reprokit.bundle.tensorfile import WrittenFile, shard, write_safetensors

        t0 = time.perf_counter()
        folder = self.folder / window_dir(step)
        files: list[dict[str, Any]] = []
        if isinstance(tensors, list):  # spilled to disk already: link the files in (no second copy)
            for i, part in enumerate(tensors):
                assert isinstance(part, WrittenFile)
                dst = folder / f"state-{i}.safetensors"
                try:
                    os.link(part.path, dst)
                except OSError:
                    shutil.copyfile(part.path, dst)
                files.append({"name": dst.name, "sha256": part.sha256, "size": part.size})
        else:
            while landed is not None and not landed():
                time.sleep(0.002)  # the snapshot's device-to-host copies are still in flight
            for i, part in enumerate(shard(tensors)):
                dst = folder / f"state-{i}.safetensors"
                sha, size = write_safetensors(dst, part)  # fsynced
                files.append({"name": dst.name, "sha256": sha, "size": size})
        with self._write_lock:
            fd = self._log_fd if self._window == step else None
        data = record_parts(b"snap", {"step": step, "tree": tree, "files": files})
        if fd is None:  # a newer window started meanwhile: append to this window's own log
            fd = os.open(folder / LOG, os.O_WRONLY | os.O_APPEND)
            try:
                _writev_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            self._write(data)
            with self._write_lock:  # a copy of the descriptor: the fsync runs without the lock, so the training
                own = os.dup(self._log_fd) if self._log_fd is not None else None  # thread's next record never waits
            if own is not None:
                try:
                    os.fsync(own)
                finally:
                    os.close(own)
        _fsync_dir(folder)
        self.stats["fsyncs"] += 1
        self.stats["bytes"] += sum(f["size"] for f in files)
        self.stats["seconds"] += time.perf_counter() - t0
        # Committed: windows before the last ``keep`` complete ones are no longer needed.
        self._complete.append(step)
        keep_from = self._complete[-min(self.keep, len(self._complete))]
        for old in [w for w in self._windows if w < keep_from]:
            shutil.rmtree(self.folder / window_dir(old), ignore_errors=True)
            self._windows.remove(old)
        _fsync_dir(self.folder)

    def windows_on_disk(self) -> list[str]:
        return sorted(p.name for p in self.folder.glob("win-*"))


def _writev_all(fd: int, parts: list[Any]) -> int:
    """Write every buffer of ``parts`` in order (``os.writev``, a short write resumed where it stopped); the bytes."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    total = sum(len(v) for v in views)
    while views:
        n = os.writev(fd, views[:_IOV_MAX])
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total


def _atomic_json(path: Path, doc: Any) -> None:
    from reprokit.bundle import dumps

    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(dumps(doc))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
