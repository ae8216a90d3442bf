"""``reprokit recover OUT_DIR``: turn the flight logs of runs that died into bundles.

A Recorder with ``durable=True`` writes its window behind to ``OUT_DIR/.reprokit-flight/<run id>/rank<k>/``
(:mod:`reprokit.flight`) and removes it when the run ends. A flight folder still there belongs to a process that
died (the kernel dropped its lock) or to one still running (its lock is held: left alone, reported as such).

For each dead rank the longest consistent prefix of its log is read (a record torn by the death is dropped and
named), the newest complete snapshot from which every later step's batch and RNG state are on disk is chosen, and
a normal bundle is written (``failure.kind == "crash"``, its window ending at the last step that started), then
verified; only then is the flight folder removed. The ranks of one torchrun job become one incident folder, laid
out as the recorder lays out incidents (``replay INCIDENT --nproc N``); a rank whose recorder had already written
its bundle of that incident before its process ended keeps that bundle.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reprokit.bundle import BundleWriter, StepRecord, open_bundle, sha256_file, verify, write_bundle
from reprokit.errors import ReprokitError
from reprokit.flight import CODE, ENV, FAULTS, FLIGHT_DIR, LOCK, LOG, OWNER, RUN, SIGTERM_LOG, Record, read_log
from reprokit.signature import Failure

FAULT_LINES = 40
_FATAL = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
          "Floating point exception": "SIGFPE", "Illegal instruction": "SIGILL"}
_OUTSIDE = ("no error recorded (SIGKILL from outside: likely the OOM killer or the scheduler, or the host died)")


@dataclass
class RankLog:
    """One rank folder of a flight log, read."""

    folder: Path
    rank: int | None = None
    world_size: int | None = None
    owner: dict[str, Any] = field(default_factory=dict)
    run: dict[str, Any] | None = None
    env: dict[str, Any] | None = None
    snaps: dict[int, dict[str, Any]] = field(default_factory=dict)
    steps: dict[int, Record] = field(default_factory=dict)
    begun: set[int] = field(default_factory=set)
    ended: dict[int, dict[str, Any]] = field(default_factory=dict)
    drops: list[int] = field(default_factory=list)
    bundles: list[dict[str, Any]] = field(default_factory=list)
    exit_note: str | None = None
    dropped: list[str] = field(default_factory=list)
    signal: str | None = None
    fault_log: str = ""
    died_at: float = 0.0
    lock_fd: int | None = None

    @property
    def last_started(self) -> int | None:
        found = self.begun | set(self.steps)
        return max(found) if found else None

    @property
    def last_finished(self) -> int | None:
        return max(self.ended) if self.ended else None


@dataclass
class RunResult:
    run: str
    status: str
    """``recovered``, ``still_running``, ``nothing_to_recover``, ``already_written`` or ``error``."""
    why: str
    bundle: str | None = None
    incident: str | None = None
    ranks: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"run": self.run, "status": self.status, "why": self.why, "bundle": self.bundle,
                "incident": self.incident, "ranks": self.ranks}


@dataclass
class RecoverReport:
    out_dir: Path
    runs: list[RunResult]

    @property
    def written(self) -> list[str]:
        """The bundles (or incident folders) this call wrote."""
        return [str(r.incident or r.bundle) for r in self.runs if r.status == "recovered" and (r.incident or r.bundle)]

    @property
    def exit_code(self) -> int:
        return 1 if any(r.status == "error" for r in self.runs) else 0

    def nothing_why(self) -> str | None:
        if self.written:
            return None
        if not self.runs:
            return (f"{self.out_dir / FLIGHT_DIR} holds no flight log: every durable run into it ended normally (which "
                    "removes its log) or was recovered already")
        return "; ".join(f"{r.run}: {r.why}" for r in self.runs)

    def to_json(self) -> dict[str, Any]:
        return {"out_dir": str(self.out_dir), "written": self.written, "nothing_to_recover": self.nothing_why(),
                "runs": [r.to_json() for r in self.runs], "exit_code": self.exit_code}


def flight_root(path: Path) -> Path | None:
    """The ``.reprokit-flight`` folder ``path`` is, is inside, or holds; None when there is none."""
    path = Path(path).absolute()
    for p in (path, *path.parents):
        if p.name == FLIGHT_DIR:
            return p
    return path / FLIGHT_DIR if (path / FLIGHT_DIR).is_dir() else None


def recover(out_dir: str | Path) -> RecoverReport:
    """Turn every dead run's flight log under ``out_dir`` into a bundle (an incident folder for several ranks).

    Idempotent: a recovered run's flight folder is removed, so a second call finds nothing to recover and says why.

    Example:
        >>> report = recover("repros")                   # doctest: +SKIP
        >>> report.written                               # doctest: +SKIP
        ['repros/bundle-20261127-101500-step00000037-crash']
    """
    root = flight_root(Path(out_dir))
    if root is None:
        return RecoverReport(Path(out_dir), [])
    out = root.parent
    results = []
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        results.append(_recover_run(out, run_dir))
    with contextlib.suppress(OSError):
        root.rmdir()  # empty now: leave no trace
    return RecoverReport(out, results)


def _recover_run(out: Path, run_dir: Path) -> RunResult:
    rank_dirs = sorted((p for p in run_dir.iterdir() if p.is_dir() and re.fullmatch(r"rank\d+", p.name)),
                       key=lambda p: int(p.name[4:]))
    logs: list[RankLog] = []
    try:
        for d in rank_dirs:
            log = _lock(d)
            if log is None:
                return RunResult(run_dir.name, "still_running", f"still running: {d} is locked by a live process "
                                 f"({_owner_text(d)}); left alone")
            logs.append(log)
        if not logs:
            shutil.rmtree(run_dir, ignore_errors=True)
            return RunResult(run_dir.name, "nothing_to_recover", "nothing to recover: an empty flight folder (a run "
                             "killed while it was being created); removed")
        for log in logs:
            _read(log)
        world = next((x.world_size for x in logs if x.world_size), None)
        if world is not None and world > 1:
            result = _recover_incident(out, run_dir, logs, world)
        else:
            result = _recover_single(out, run_dir, logs[0])
        if result.status != "error":
            shutil.rmtree(run_dir, ignore_errors=True)
        return result
    finally:
        for log in logs:
            if log.lock_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(log.lock_fd)


def _lock(folder: Path) -> RankLog | None:
    """The rank folder with its lock taken (the process that held it is dead), or None when a live process holds it."""
    log = RankLog(folder)
    path = folder / LOCK
    if not path.exists():
        return log  # killed before it made its lock: nothing of it can be live
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    log.lock_fd = fd
    return log


def _owner_text(folder: Path) -> str:
    try:
        o = json.loads((folder / OWNER).read_text())
        return f"pid {o.get('pid')} on {o.get('host')}"
    except (OSError, ValueError):
        return "owner unknown"


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_rank(folder: Path) -> RankLog:
    """One rank folder of a flight log, read (:func:`window_chain` picks a window of it, :func:`write_window` writes
    it). Takes no lock: the recorder also reads its own live log this way (a peer's death, see
    :meth:`reprokit.record.Recorder._peer_window`), and a record being appended reads as torn and ends the log."""
    log = RankLog(Path(folder))
    _read(log)
    return log


def _read(log: RankLog) -> None:
    """Parse everything the rank folder holds."""
    f = log.folder
    log.owner = _json(f / OWNER) or {}
    log.run = _json(f / RUN)
    log.env = _json(f / ENV)
    if isinstance(log.owner.get("rank"), int):
        log.rank = log.owner["rank"]
    if isinstance(log.owner.get("world_size"), int):
        log.world_size = log.owner["world_size"]
    for win in sorted(f.glob("win-*")):
        got = read_log(win / LOG)
        if got.dropped:
            log.dropped.append(got.dropped)
        with contextlib.suppress(OSError):
            log.died_at = max(log.died_at, (win / LOG).stat().st_mtime)
        for r in got.records:
            step = r.header.get("step")
            if r.kind == "snap" and isinstance(step, int):
                log.snaps[step] = {**r.header, "folder": win}
            elif r.kind == "step" and isinstance(step, int):
                log.steps[step] = r
            elif r.kind == "begn" and isinstance(step, int):
                log.begun.add(step)
            elif r.kind == "end" and isinstance(step, int):
                log.ended[step] = r.header
            elif r.kind == "drop" and isinstance(step, int):
                log.drops.append(step)
            elif r.kind == "bndl":
                log.bundles.append(r.header)
            elif r.kind == "exit":
                log.exit_note = str(r.header.get("why", ""))
    faults = _text(f / FAULTS)
    lines = faults.splitlines()
    log.fault_log = "\n".join(lines[-FAULT_LINES:])
    for line in reversed(lines):
        m = re.match(r"Fatal Python error: (.+?)\s*$", line)
        if m and m[1] in _FATAL:
            log.signal = _FATAL[m[1]]
            break
    if log.signal is None and _text(f / SIGTERM_LOG).strip():
        log.signal = "SIGTERM"
        log.fault_log = "\n".join(_text(f / SIGTERM_LOG).splitlines()[-FAULT_LINES:])
    with contextlib.suppress(OSError):
        log.died_at = max(log.died_at, (f / FAULTS).stat().st_mtime if log.signal else 0)


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def window_chain(log: RankLog, start: int | None = None) -> tuple[int, list[int]] | str:
    """The newest complete snapshot (``start``: that one) from which every step up to the last recorded one is on
    disk with nothing dropped in between: ``(snapshot step, steps)``; else why there is none."""
    if not log.steps:
        return "no step's batch reached the log"
    last = max(log.steps)
    problems = []
    for s in sorted(log.snaps, reverse=True):
        if start is not None and s != start:
            continue
        if s > last:
            continue
        steps = list(range(s, last + 1))
        gap = next((k for k in steps if k not in log.steps), None)
        if gap is not None:
            problems.append(f"the window from step {s} lacks step {gap}'s batch")
            continue
        if any(s < d <= last for d in log.drops):
            problems.append(f"the recorder dropped the window from step {s} (a torn snapshot, an interrupted step, "
                            "a step over the memory budget)")
            continue
        bad = _snapshot_problem(log.snaps[s])
        if bad:
            problems.append(bad)
            continue
        return s, steps
    if not log.snaps:
        return (f"no complete snapshot on disk (the process died at step {log.last_started} before its first "
                "snapshot was written and fsynced)")
    if start is not None and start not in log.snaps:
        return f"no snapshot at step {start}, where the other ranks' windows start"
    return "no usable snapshot: " + "; ".join(problems)


def _snapshot_problem(snap: dict[str, Any]) -> str | None:
    for f in snap.get("files") or []:
        path = Path(snap["folder"]) / str(f.get("name"))
        try:
            if path.stat().st_size != f.get("size") or sha256_file(path) != f.get("sha256"):
                return f"the snapshot at step {snap['step']} does not match its checksum ({path.name})"
        except OSError:
            return f"the snapshot at step {snap['step']} lacks {path.name}"
    return None


def _failure(log: RankLog, step: int, incident: dict[str, Any] | None = None) -> Failure:
    started, finished = log.last_started, log.last_finished
    assert started is not None
    sig = log.signal
    during = f"during step {started}" if finished is None or finished < started else \
        f"after step {started} finished, before the next one started"
    if finished == started and log.ended[started].get("failed"):
        during = f"after step {started} failed in Python (the recorder's bundle of it was not finished)"
    if sig == "SIGTERM":
        message = (f"the process was terminated (SIGTERM) {during}: the scheduler or torchrun stopping the job, or "
                   "its launcher after another rank died")
    elif sig is not None:
        message = f"the process died with {sig} {during}"
    elif log.exit_note:
        message = f"the process ended {during}: {log.exit_note}"
    else:
        message = f"the process ended {during} with {_OUTSIDE}"
    dropped = "; ".join(log.dropped) or None
    if step != started:
        lost = f"step {started} started but its batch had not reached the log (an asynchronous GPU copy)"
        dropped = f"{dropped}; {lost}" if dropped else lost
    detail: dict[str, Any] = {"last_started": started, "last_finished": finished, "signal": sig,
                              "fault_log": log.fault_log, "rank": log.rank, "world_size": log.world_size,
                              "pid": log.owner.get("pid"), "host": log.owner.get("host"),
                              "recovered_from": str(log.folder), "dropped": dropped}
    if incident is not None:
        detail["incident"] = incident
    return Failure(kind="crash", step=step, exc_type=sig, message=message, detail=detail)


def _stamp(log: RankLog) -> str:
    when = _dt.datetime.fromtimestamp(log.died_at) if log.died_at else _dt.datetime.now()
    return when.strftime("%Y%m%d-%H%M%S")


def _tag(log: RankLog) -> str:
    if log.rank is None or not log.world_size or log.world_size < 2:
        return ""
    width = len(str(log.world_size - 1))
    return f"-rank{log.rank:0{width}d}of{log.world_size}"


def write_window(log: RankLog, where: Path, chain: tuple[int, list[int]], failure: Failure,
           incident: str | None = None) -> Path:
    """Write and verify the bundle of ``log`` (a ``crash``, or a live rank's ``peer`` window of a dead rank's incident);
    an invalid one is removed (never left behind)."""
    from reprokit.bundle.tensorfile import WrittenFile

    start, steps = chain
    snap = log.snaps[start]
    if log.run is None or log.env is None:
        raise ReprokitError(f"{log.folder}: run.json or env.json is missing or damaged")
    history = [{"step": k, "loss": e.get("loss"), "grad_norm": e.get("grad_norm"), "lr": None, "loss_scale": None}
               for k, e in sorted(log.ended.items())]
    run = {**log.run, "window": {"start": start, "end": steps[-1], "steps": steps}, "history": history}
    if "distributed" in run and isinstance(run["distributed"], dict):
        run["distributed"] = {**run["distributed"], "incident": incident}
    run["recovered"] = {"from": str(log.folder), "dropped": failure.detail.get("dropped")}
    files = [WrittenFile(Path(snap["folder"]) / f["name"], f["sha256"], f["size"]) for f in snap["files"]]

    def records() -> Any:
        for k in steps:
            r = log.steps[k]
            end = log.ended.get(k, {})
            yield StepRecord(k, r.header.get("batch"), r.tensors(), r.header.get("rng") or {}, end.get("loss"),
                             end.get("grad_norm"))

    code_dir = log.folder / CODE
    code = sorted((str(p.relative_to(code_dir)), p) for p in code_dir.rglob("*") if p.is_file()) \
        if code_dir.is_dir() else []
    stamp = _stamp(log) if failure.kind == "crash" else _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = f"bundle-{stamp}-step{failure.step:08d}-{failure.kind}{_tag(log)}"
    w = BundleWriter(where, name)
    path = write_bundle(w, failure=failure.to_json(), run=run, env=log.env, state=(snap["tree"], files), steps=records(),
                        code=code)
    problems = verify(path)
    if problems:
        shutil.rmtree(path, ignore_errors=True)
        raise ReprokitError(f"the bundle recovered from {log.folder} failed verification ({problems[:3]}); removed")
    return path


def _already(log: RankLog, incident: str | None = None) -> dict[str, Any] | None:
    """The bundle the recorder wrote itself for the step the process ended in (its failure, before the death), or
    for ``incident`` (the run's last declared one: a peer's bundle names the step the incident is about, not the
    step this rank had reached)."""
    started = log.last_started
    for b in reversed(log.bundles):
        if (b.get("step") == started or (incident and b.get("incident") == incident)) and \
                Path(str(b.get("path"))).is_dir():
            return b
    return None


def _bundles_in(folder: Path) -> dict[int, int]:
    """``{rank: the step its window starts at}`` of the rank bundles in an incident folder (verified when replayed)."""
    found = {}
    with contextlib.suppress(OSError):
        for p in folder.iterdir():
            run = _json(p / RUN) if (p / "manifest.json").is_file() else None
            window = run.get("window") if isinstance(run, dict) else None
            dist = run.get("distributed") if isinstance(run, dict) else None
            if isinstance(window, dict) and isinstance(window.get("start"), int) and isinstance(dist, dict) and \
                    isinstance(dist.get("rank"), int):
                found[int(dist["rank"])] = int(window["start"])
    return found


def _recover_single(out: Path, run_dir: Path, log: RankLog) -> RunResult:
    info = {"rank": log.rank, "dropped": "; ".join(log.dropped) or None}
    if log.last_started is None:
        return RunResult(run_dir.name, "nothing_to_recover", "nothing to recover: the process died before its first "
                         "step reached the flight log; removed", ranks=[info])
    done = _already(log)
    if done is not None:
        return RunResult(run_dir.name, "already_written", f"nothing to recover: the run's failure at step "
                         f"{done['step']} was written as {done['path']} before the process ended; removed the flight "
                         "log", bundle=str(done["path"]), ranks=[info])
    chain = window_chain(log)
    if isinstance(chain, str):
        return RunResult(run_dir.name, "nothing_to_recover", f"nothing to recover: {chain}; removed the flight log",
                         ranks=[info])
    failure = _failure(log, chain[1][-1])
    try:
        path = write_window(log, out, chain, failure)
    except Exception as e:
        return RunResult(run_dir.name, "error", f"could not write the bundle ({e}); the flight log is kept",
                         ranks=[info])
    info.update(status="recovered", bundle=str(path), step=failure.step, signal=failure.exc_type)
    return RunResult(run_dir.name, "recovered", failure.message, bundle=str(path), ranks=[info])


_PRIORITY = {None: 1, "SIGTERM": 2}


def _recover_incident(out: Path, run_dir: Path, logs: list[RankLog], world: int) -> RunResult:
    """The ranks of one job: one incident folder (the one the recorder already started, if a rank wrote its bundle of
    it before the job died, or the one a live rank declared when it found a peer dead), with a crash bundle for every
    rank that has none there, its window starting where the bundles already there start."""
    key = str(next((x.owner.get("run_key") for x in logs if x.owner.get("run_key")), run_dir.name))
    declared = _declared(out, key.removeprefix("run-"))
    done = {log.rank: b for log in logs if (b := _already(log, declared.get("incident"))) is not None
            and b.get("incident")}
    need = [log for log in logs if log.rank not in done and log.last_started is not None]
    infos = []
    present = _bundles_in(out / str(declared["incident"])) if declared.get("incident") else {}
    if done:
        first = next(iter(done.values()))
        name = str(first["incident"])
        where = Path(str(first["path"])).parent
        doc = dict(open_bundle(first["path"]).failure.detail.get("incident") or {})
        start = int(open_bundle(first["path"]).run["window"]["start"])
    else:
        if not need:
            return RunResult(run_dir.name, "nothing_to_recover", "nothing to recover: no rank's step reached the "
                             "flight log; removed")
        origin = min(need, key=lambda x: (_PRIORITY.get(x.signal, 0), x.last_started, x.rank))
        doc = {"incident": None, "step": origin.last_started, "rank": origin.rank,
               "what": _failure(origin, origin.last_started or 0).message, "world_size": world, "number": 0}
        if isinstance(declared.get("died"), dict):  # a live rank found it dead and declared the incident for it
            doc.update({k: declared[k] for k in ("step", "rank", "what", "died") if k in declared})
        # The ranks' windows must start at the same step (their collectives line up in a replay).
        chains = [window_chain(x) for x in need]
        if any(isinstance(c, str) for c in chains):
            why = "; ".join(f"rank {x.rank}: {c}" for x, c in zip(need, chains) if isinstance(c, str))
            return RunResult(run_dir.name, "nothing_to_recover", f"nothing to recover: {why}; removed the flight log")
        starts = sorted({s for x in need for s in x.snaps}, reverse=True)
        if present:  # live ranks wrote their windows of this incident already: the recovered ones start there too
            starts = sorted(set(present.values()))
        common = next((s for s in starts if all(not isinstance(window_chain(x, s), str) for x in need)), None)
        if common is None:
            if not present:
                return RunResult(run_dir.name, "nothing_to_recover", "nothing to recover: the ranks' flight logs hold "
                                 "no snapshot step they all have a whole window from; removed the flight log")
            why = "; ".join(f"rank {x.rank}: {c}" for x in need if isinstance(c := window_chain(x, starts[0]), str))
            return RunResult(run_dir.name, "nothing_to_recover", f"nothing to recover: the windows already in "
                             f"{declared['incident']} start at step {starts[0]}, and the dead ranks' flight logs hold "
                             f"none from there ({why}); removed the flight log")
        start = common
        name = str(declared.get("incident") or f"incident-{_stamp(origin)}-step{int(origin.last_started or 0):08d}-"
                                               f"{key.removeprefix('run-')[:8]}")
        doc["incident"] = name
        if declared.get("number") is not None:
            doc["number"] = declared["number"]
        where = out / name
    for r, b in sorted(done.items()):
        infos.append({"rank": r, "status": "already_written", "bundle": b["path"]})
    for r in sorted(set(present) - set(done) - {x.rank for x in need}):
        infos.append({"rank": r, "status": "already_written", "why": f"its window is in {where} (a live rank)"})
    written = []
    for log in need:
        chain = window_chain(log, start)
        info: dict[str, Any] = {"rank": log.rank, "dropped": "; ".join(log.dropped) or None}
        if isinstance(chain, str):
            info.update(status="nothing_to_recover", why=chain)
            infos.append(info)
            continue
        failure = _failure(log, chain[1][-1], doc)
        try:
            path = write_window(log, where, chain, failure, incident=name)
        except Exception as e:
            info.update(status="error", why=str(e))
            infos.append(info)
            continue
        written.append(path)
        info.update(status="recovered", bundle=str(path), step=failure.step, signal=failure.exc_type,
                    why=failure.message)
        infos.append(info)
    if not written:
        whys = "; ".join(f"rank {i['rank']}: {i.get('why')}" for i in infos if i.get("why"))
        return RunResult(run_dir.name, "nothing_to_recover", f"nothing to recover: {whys or 'no rank had a window'}",
                         ranks=infos)
    if any(i.get("status") == "error" for i in infos):
        return RunResult(run_dir.name, "error", "some ranks could not be written; the flight log is kept",
                         incident=str(where), ranks=infos)
    missing = sorted(set(range(world)) - {i["rank"] for i in infos if i.get("status") != "nothing_to_recover"})
    why = f"incident of {world} ranks: {doc.get('what')}" + (f" (ranks {missing} have no window)" if missing else "")
    return RunResult(run_dir.name, "recovered", why, incident=str(where), ranks=infos)


def _declared(out: Path, run_key: str) -> dict[str, Any]:
    """The last incident a rank of this run declared before the job died (its bundle may not have been written):
    the recovered bundles join its folder rather than start another one."""
    from reprokit.distributed import INCIDENTS_DIR

    found = []
    for p in (out / INCIDENTS_DIR).glob(f"{run_key}.*.json"):
        m = re.fullmatch(re.escape(run_key) + r"\.(\d+)\.json", p.name)
        doc = _json(p) if m else None
        if isinstance(doc, dict) and isinstance(doc.get("incident"), str):
            found.append((int(m[1]) if m else 0, doc))
    return max(found, key=lambda x: x[0])[1] if found else {}


def recovered_input(path: Path) -> tuple[Path, str | None]:
    """For ``replay``, ``inspect``, ``shrink``: when ``path`` is a flight folder, or an out_dir that holds flight logs
    of dead runs and no bundle of its own at that path, run :func:`recover` first and return what it wrote (when it
    wrote exactly one bundle or incident) and a line saying so; else ``(path, None)``."""
    path = Path(path)
    if (path / "manifest.json").exists():
        return path, None
    root = flight_root(path)
    if root is None or not root.is_dir():
        return path, None
    report = recover(root.parent)
    written = report.written
    if len(written) == 1:
        return Path(written[0]), f"reprokit: recovered {written[0]} from the flight log in {root} (reprokit recover)"
    if written:
        raise ReprokitError(f"reprokit recover wrote {len(written)} bundles from {root}: {', '.join(written)}; pass "
                            "one of them")
    if path.name == FLIGHT_DIR or root in path.absolute().parents or path.absolute() == root:
        raise ReprokitError(f"{path}: {report.nothing_why()}")
    return path, None


def format_recover(d: dict[str, Any]) -> str:
    """The human form of :meth:`RecoverReport.to_json` (``reprokit recover`` without ``--json``)."""
    lines = []
    for r in d["runs"]:
        head = {"recovered": "recovered", "still_running": "still running", "nothing_to_recover": "nothing",
                "already_written": "already written", "error": "ERROR"}.get(r["status"], r["status"])
        lines.append(f"{r['run']}: {head}: {r['why']}")
        if r.get("incident"):
            lines.append(f"  incident {r['incident']}")
        elif r.get("bundle") and r["status"] == "recovered":
            lines.append(f"  bundle   {r['bundle']}")
        for rank in r["ranks"]:
            if r.get("incident"):
                lines.append(f"  rank {rank.get('rank')}: {rank.get('status')} {rank.get('bundle') or rank.get('why') or ''}")
            if rank.get("dropped"):
                lines.append(f"  dropped  {rank['dropped']}")
    if d.get("nothing_to_recover"):
        lines.append(f"nothing to recover: {d['nothing_to_recover']}" if not d["runs"] else
                     "nothing to recover (see above)")
    for w in d["written"]:
        q = shlex.quote(w)
        lines.append(f"next: `reprokit inspect {q}`, `reprokit replay {q}`")
    return "\n".join(lines)
