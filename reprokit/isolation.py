"""Replays that may kill the process, run in a child process.

A step that segfaults in an extension, calls ``abort()``, is killed by a signal or poisons the CUDA context would
take reprokit down with it. :class:`IsolatedRunner` runs each replay attempt in a child (``python -m
reprokit.isolation``) that runs the ordinary :class:`~reprokit.replay.Session`, and tells its parent on a pipe as
each step starts and finishes, then the run's outcome. When the child dies instead, the parent knows the step it
died in (the last one started) and how (the signal, from its exit status), and makes of that a ``crash`` failure,
judged against the recorded one like any other (:func:`reprokit.signature.same_failure`).

Importing torch costs seconds, so a child that ends an attempt alive runs the next one, and a spare child starts up
while each attempt runs, to take over at once from a child the attempt killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from reprokit import errors
from reprokit.signature import Failure

STARTUP_LIMIT_S = 600.0
"""Seconds a child may take to import torch and reprokit before the runner gives up on it."""
LOG_TAIL_LINES = 20
"""Lines of a dead child's output (its ``faulthandler`` traceback, a CUDA error) kept in its death record."""
KILLED_FROM_OUTSIDE = ("the process was killed from outside (SIGKILL with no error recorded): likely the OOM killer "
                       "or the scheduler")


@dataclass
class Attempt:
    """One replay attempt in a child process.

    ``outcome`` is None when the attempt gave no verdict (it ran past its time limit and was killed); for a child
    that died it is a run whose failure is a ``crash`` (``outcome.death`` says how).
    """

    outcome: Any  # RunOutcome | None (replay imports torch; this module's parent side need not)
    device: str | None = None
    code: str | None = None
    same_device: bool = False
    peak_rss_bytes: int | None = None
    timed_out: bool = False


@dataclass
class _Child:
    proc: subprocess.Popen
    events: int
    log: Path
    started: float
    buf: bytearray = field(default_factory=bytearray)
    ready: bool = False


class IsolatedRunner:
    """Child processes that run replay attempts, one at a time, each child reused until it dies.

    Use as a context manager: children still alive at the end are stopped, their scratch folder removed.

    Example:
        >>> with IsolatedRunner() as runner:                                        # doctest: +SKIP
        ...     a = runner.attempt(bundle.path, recorded=bundle.failure)
        ...     a.outcome.verdict, a.outcome.death
        ('reproduced', {'signal': 'SIGSEGV', 'step': 37, ...})
    """

    def __init__(self) -> None:
        from reprokit.code import child_env

        self._tmp = Path(tempfile.mkdtemp(prefix="reprokit-isolate-"))
        root = str(Path(__file__).resolve().parent.parent)  # this reprokit, whatever the child's path says
        env = child_env(self._tmp)  # the children's code copies go there: removed with it, even after a kill
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        self._env = env
        self._child: _Child | None = None
        self._spare: _Child | None = None
        self.starts = 0
        """Children started."""
        self.deaths = 0
        """Children that died during an attempt (or were killed for running past its limit)."""
        self.startup_seconds = 0.0
        """Summed over the children: from their start until they were ready (python, torch and reprokit imported)."""
        self.waited_seconds = 0.0
        """Of that, the time the caller waited for a child to be ready (a replacement starts while the caller works)."""
        self.keep_warm = True
        """Keep a spare child starting up while an attempt runs, to take over at once if the attempt kills its child
        (set False before the last attempt: none would use it)."""

    def __enter__(self) -> IsolatedRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the children (each leaves when its input closes; killed if not within 5 s); remove the scratch."""
        children = [c for c in (self._child, self._spare) if c is not None]
        self._child = self._spare = None
        for child in children:
            with contextlib.suppress(OSError):
                child.proc.stdin.close()  # type: ignore[union-attr]
            try:
                child.proc.wait(5)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
            os.close(child.events)
        shutil.rmtree(self._tmp, ignore_errors=True)

    def summary(self) -> dict[str, Any]:
        """What isolation cost: children started and died, their start-up time, and how much of it was waited for."""
        return {"child_starts": self.starts, "child_deaths": self.deaths,
                "startup_seconds": round(self.startup_seconds, 3), "waited_seconds": round(self.waited_seconds, 3)}

    def attempt(self, bundle: str | Path, *, recorded: Failure, device: str | None = None,
                code: str | Path | None = None, timeout: float | None = None) -> Attempt:
        """Replay ``bundle``'s window once in a child; judge a death against ``recorded`` (the bundle's failure).

        Raises:
            ReprokitError: the child could not replay the bundle (the error the replay raised there, such as a
                :class:`~reprokit.errors.CodeLoadError`, of the same class), or could not start at all.
        """
        child = self._ready_child()
        request = {"bundle": str(bundle), "device": device, "code": str(code) if code is not None else None}
        started: list[int] = []
        finished: dict[int, float | None] = {}
        t0 = time.perf_counter()
        deadline = None if timeout is None else t0 + timeout
        try:
            assert child.proc.stdin is not None
            child.proc.stdin.write(json.dumps(request) + "\n")
            child.proc.stdin.flush()
        except OSError:
            pass  # it died since it said it was ready: the events pipe says so next
        if self.keep_warm and self._spare is None:
            self._spare = self._spawn()  # imports torch while this attempt runs
        died: dict[str, Any] | None = None
        while True:
            event = self._next_event(child, deadline)
            if event is None or event["event"] == "died":
                died = event
                break
            if event["event"] == "timeout":
                return self._killed(child, timeout)
            if event["event"] == "started":
                started.append(event["step"])
            elif event["event"] == "finished":
                finished[event["step"]] = event["loss"]
            elif event["event"] == "error":
                raise _error_of(event)
            elif event["event"] == "result":
                return _attempt_of(event)
        return self._death(child, recorded, died, started, finished, time.perf_counter() - t0)

    # -- children ------------------------------------------------------------------------------------------------

    def _spawn(self) -> _Child:
        read, write = os.pipe()
        log = self._tmp / f"child-{self.starts}.log"
        try:
            with open(log, "wb") as out:
                proc = subprocess.Popen([sys.executable, "-m", "reprokit.isolation", str(write)], stdin=subprocess.PIPE,
                                        stdout=out, stderr=subprocess.STDOUT, pass_fds=(write,), env=self._env,
                                        text=True)
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)  # the child holds its end: end of file on ours means it is gone
        self.starts += 1
        return _Child(proc, read, log, time.perf_counter())

    def _ready_child(self) -> _Child:
        """The live child, ready for a request (started now, or waited for, if need be)."""
        if self._child is None or self._child.proc.poll() is not None:
            if self._child is not None:
                self._reap(self._child)
            self._child, self._spare = self._spare or self._spawn(), None
        child = self._child
        if not child.ready:
            t0 = time.perf_counter()
            event = self._next_event(child, child.started + STARTUP_LIMIT_S)
            self.waited_seconds += time.perf_counter() - t0
            if event is None or event["event"] != "ready":
                tail = _tail(child.log)
                self._reap(child)
                self._child = None
                why = "did not start in time" if event and event["event"] == "timeout" else "died while starting"
                raise errors.ReprokitError(f"the child process that replays in isolation {why} ({sys.executable} -m "
                                           f"reprokit.isolation); its last output:\n{tail or '(none)'}")
            child.ready = True
            self.startup_seconds += time.perf_counter() - child.started
        return child

    def _next_event(self, child: _Child, deadline: float | None) -> dict[str, Any] | None:
        """The child's next event; None at end of file (it is gone); ``{"event": "timeout"}`` past ``deadline``."""
        while b"\n" not in child.buf:
            wait = None if deadline is None else max(0.0, deadline - time.perf_counter())
            ready, _, _ = select.select([child.events], [], [], wait)
            if not ready:
                return {"event": "timeout"}
            data = os.read(child.events, 1 << 16)
            if not data:
                return None
            child.buf += data
        line, _, rest = bytes(child.buf).partition(b"\n")
        child.buf = bytearray(rest)
        return json.loads(line)

    def _reap(self, child: _Child, wait_s: float = 30.0) -> tuple[int, int | None]:
        """Wait for a child that is going (killed after ``wait_s``): ``(returncode, peak RSS in bytes)``
        (``returncode < 0``: killed by that signal). ``wait4`` reads the peak of that child alone."""
        with contextlib.suppress(OSError):
            child.proc.stdin.close()  # type: ignore[union-attr]
        with contextlib.suppress(OSError):
            os.close(child.events)
        if child.proc.returncode is not None:  # already reaped (by poll())
            return child.proc.returncode, None
        deadline = time.monotonic() + wait_s
        try:
            while True:
                pid, status, usage = os.wait4(child.proc.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() > deadline:
                    child.proc.kill()
                    _, status, usage = os.wait4(child.proc.pid, 0)
                    break
                time.sleep(0.005)
        except ChildProcessError:
            return child.proc.poll() or 0, None
        child.proc.returncode = os.waitstatus_to_exitcode(status)
        return child.proc.returncode, usage.ru_maxrss * 1024  # kB on Linux

    def _killed(self, child: _Child, timeout: float | None) -> Attempt:
        child.proc.kill()
        _, peak = self._reap(child, 0.0)
        self.deaths += 1
        self._child = None  # the spare takes over
        return Attempt(None, peak_rss_bytes=peak, timed_out=True)

    def _death(self, child: _Child, recorded: Failure, died: dict[str, Any] | None, started: list[int],
               finished: dict[int, float | None], seconds: float) -> Attempt:
        from reprokit.replay import RunOutcome

        rc, peak = self._reap(child)  # its pipe closed: it is leaving
        self.deaths += 1
        self._child = None  # the spare, started with the attempt, takes over
        tail = _tail(child.log)
        failure = death_failure(rc, died, started, finished, tail, child.proc.pid)
        death = {"signal": failure.detail["signal"], "returncode": rc, "step": failure.step, "where": fault_frame(tail),
                 "last_started": failure.detail["last_started"], "last_finished": failure.detail["last_finished"],
                 "peak_rss_bytes": peak, "output_tail": tail}
        outcome = RunOutcome(failure, failure.same_as(recorded, step=True), dict(finished), seconds, death=death)
        return Attempt(outcome, peak_rss_bytes=peak)


def death_failure(returncode: int, died: dict[str, Any] | None, started: list[int], finished: dict[int, Any],
                  output_tail: str, pid: int) -> Failure:
    """The ``crash`` failure of a child that ended without a result: by a signal (``returncode < 0``), an uncaught
    exception (``died``, the child's last word), or an exit status. Its step is the last one started (-1: none)."""
    sig = signal.Signals(-returncode).name if returncode < 0 and -returncode in signal.valid_signals() else None
    last = started[-1] if started else None
    exc_type: str | None
    if sig is not None:
        exc_type, message = sig, signal.strsignal(-returncode) or sig
    elif died is not None:
        exc_type, message = died.get("exc_type"), str(died.get("message", ""))
    else:
        exc_type, message = None, f"exited with status {returncode} without a result"
    if last is None:
        message += "; before its first step (while loading the bundle or running build())"
    return Failure("crash", last if last is not None else -1, exc_type=exc_type, message=message[:500],
                   detail={"last_started": last, "last_finished": max(finished) if finished else None,
                           "signal": sig, "fault_log": output_tail, "rank": None, "world_size": None, "pid": pid,
                           "host": platform.node(), "recovered_from": None, "dropped": None,
                           "returncode": returncode})


_FAULT_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')


def fault_frame(output: str) -> str | None:
    """``file:line in function`` of the innermost frame in user code of a ``faulthandler`` traceback (which lists
    the most recent call first), or None when the output holds none."""
    from reprokit.signature import in_library

    for line in output.splitlines():
        m = _FAULT_FRAME.match(line)
        if m and not m["file"].startswith("<") and not in_library(m["file"]):
            return f"{os.path.basename(m['file'])}:{m['line']} in {m['name']}"
    return None


def _attempt_of(event: dict[str, Any]) -> Attempt:
    from reprokit.replay import RunOutcome

    failure = Failure.from_json(event["failure"]) if event["failure"] else None
    losses = {int(k): v for k, v in event["losses"]}
    outcome = RunOutcome(failure, event["same"], losses, event["seconds"])
    return Attempt(outcome, event["device"], event["code"], event["same_device"], event["peak_rss_bytes"])


def _error_of(event: dict[str, Any]) -> errors.ReprokitError:
    """The error the child's replay raised, as the same class here (its exit code and attributes with it)."""
    cls = getattr(errors, event["error"], None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ReprokitError)):
        return errors.ReprokitError(f"the replay failed in its child process: {event['error']}: {event['message']}")
    e = cls.__new__(cls)
    Exception.__init__(e, event["message"])
    for k, v in (event.get("attributes") or {}).items():
        setattr(e, k, v)
    return e


def _tail(log: Path) -> str:
    try:
        text = log.read_bytes()[-16384:].decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-LOG_TAIL_LINES:])


# -- the parent side of replay ------------------------------------------------------------------------------------

def replay_isolated(bundle: Any, *, times: int = 1, device: str | None = None, code: str | Path | None = None,
                    progress: Any = None) -> Any:
    """:func:`reprokit.replay.replay` with each run in a child process (see the module docstring).

    A run whose child died is a ``crash`` at the step it started last: it reproduces a recorded crash that died the
    same way there (the same signal; any signal when the bundle recorded none; the same exception class for a death
    by an uncaught exception), and a recorded device error of the same exception class. Deterministic and flaky are
    told apart over ``times`` runs as in-process. ``report.isolation`` says what isolation cost and, for a crash
    that replays clean, what that means, with the peak host memory of a run beside the recorded machine's memory.
    """
    from reprokit.replay import code_label, default_device, loss_fidelity, report_of

    runs, attempts = [], []
    with IsolatedRunner() as runner:
        for i in range(times):
            runner.keep_warm = i < times - 1
            a = runner.attempt(bundle.path, recorded=bundle.failure, device=device, code=code)
            attempts.append(a)
            runs.append(a.outcome)
            if progress:
                progress(i + 1, times)
    seen = next((a for a in attempts if a.device is not None), None)
    for a in attempts:
        a.outcome.fidelity = loss_fidelity(bundle, a.outcome.losses, same_device=bool(seen and seen.same_device),
                                           same_code=code is None)
    where = seen.device if seen else device or default_device(bundle)
    label = seen.code if seen and seen.code else code_label(bundle, Path(code).resolve() if code else None)
    report = report_of(bundle, runs, str(where), label)
    report.isolation = isolation_summary(report, attempts, runner.summary(), bundle.env)
    return report


def isolation_summary(report: Any, attempts: list[Attempt], cost: dict[str, Any],
                      env: dict[str, Any]) -> dict[str, Any]:
    """``report.isolation``: the cost, the death that the verdict rests on, peak memory, and the note for a crash
    with no error recorded that replayed clean."""
    recorded = report.recorded
    deaths = [r.death for r in report.runs if r.death]
    death = next((r.death for r in report.runs if r.same and r.death), deaths[0] if deaths else None)
    peaks = [a.peak_rss_bytes for a in attempts if a.peak_rss_bytes]
    note = None
    if recorded.kind == "crash" and recorded.exc_type in (None, "SIGKILL") and report.verdict == "not_reproduced":
        note = KILLED_FROM_OUTSIDE
    return {"isolated": True, **cost, "signal": death["signal"] if death else None,
            "step": death["step"] if death else None, "where": death["where"] if death else None,
            "peak_rss_bytes": max(peaks) if peaks else None,
            "recorded_memory_bytes": recorded_memory(env), "note": note}


def recorded_memory(env: dict[str, Any]) -> int | None:
    """The recorded machine's host memory in bytes, where its env.json says (``memory_bytes``)."""
    value = env.get("memory_bytes")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def isolation_lines(iso: dict[str, Any] | None) -> list[str]:
    """The lines ``reprokit replay`` prints about isolation (none for an in-process replay)."""
    if not iso:
        return []
    starts = iso["child_starts"]
    line = (f"  isolation: each run in a child process ({starts} started, {iso['startup_seconds']:.1f}s of start-up, "
            f"{iso['waited_seconds']:.1f}s waited for)")
    if iso.get("peak_rss_bytes"):
        line += f"; peak host memory {_size(iso['peak_rss_bytes'])}"
        mem = iso.get("recorded_memory_bytes")
        line += f" (recorded machine: {_size(mem)})" if mem else " (the recorded machine's memory is not in env.json)"
    out = [line]
    if iso.get("where"):
        out.append(f"  died in {iso['where']} (the child's faulthandler traceback)")
    if iso.get("note"):
        out.append(f"  note: {iso['note']}")
    return out


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


# -- the child ----------------------------------------------------------------------------------------------------

def _send(fd: int, event: dict[str, Any]) -> None:
    data = (json.dumps(event) + "\n").encode()
    while data:  # a pipe takes a large write in parts
        data = data[os.write(fd, data):]


def _reset_peak() -> None:
    """Start this process's peak RSS afresh (Linux: writing 5 to clear_refs resets VmHWM); else keep it."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_rss() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _Served:
    """The child's open session: kept while requests name the same bundle, code and device."""

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None
        self.session: Any = None
        self.inputs: Any = None

    def open(self, key: tuple[Any, ...]) -> Any:
        from reprokit.bundle import open_bundle
        from reprokit.replay import Session

        if key == self.key:
            return self.session
        self.close()
        path, device, code = key
        s = Session(open_bundle(path), device=device, code=code, preload=True)
        s.__enter__()
        self.key, self.session, self.inputs = key, s, s.inputs()
        return s

    def close(self) -> None:
        s, self.session, self.key, self.inputs = self.session, None, None, None
        if s is not None:
            s.__exit__(None, None, None)
            s.drop_code_copy()


def _serve(fd: int, requests: IO[str]) -> None:
    served = _Served()
    _send(fd, {"event": "ready", "pid": os.getpid()})
    for line in requests:
        req = json.loads(line)
        try:
            s = served.open((req["bundle"], req["device"], req["code"]))
        except errors.ReprokitError as e:
            _send(fd, {"event": "error", "error": type(e).__name__, "message": str(e),
                       "attributes": {k: getattr(e, k) for k in ("problems", "cli_message") if hasattr(e, k)}})
            continue
        s.on_step = lambda what, step, loss: _send(fd, {"event": what, "step": step, "loss": loss})
        _reset_peak()
        try:
            out = s.run(served.inputs)
        except BaseException as e:  # SystemExit, KeyboardInterrupt from the step: a Python-level death
            _send(fd, {"event": "died", "exc_type": type(e).__qualname__, "message": str(e).splitlines()[0][:500]
                       if str(e) else ""})
            sys.stderr.flush()
            os._exit(70)
        _send(fd, {"event": "result", "failure": out.failure.to_json() if out.failure else None, "same": out.same,
                   "losses": list(out.losses.items()), "seconds": out.seconds, "device": str(s.device),
                   "code": s.code_label, "same_device": s.same_device(), "peak_rss_bytes": _peak_rss()})
    served.close()


def main(argv: list[str]) -> None:
    """``python -m reprokit.isolation FD``: serve replay requests (JSON lines on stdin), events on file FD."""
    import faulthandler

    fd = int(argv[0])
    os.set_inheritable(fd, False)  # processes the step starts must not keep the parent's end-of-file away
    faulthandler.enable(all_threads=True)  # a segfault's Python traceback goes to the log the parent keeps
    import reprokit.replay  # noqa: F401 - torch and reprokit before "ready": the start-up cost is the child's own

    _serve(fd, sys.stdin)


if __name__ == "__main__":
    main(sys.argv[1:])


__all__ = ["KILLED_FROM_OUTSIDE", "Attempt", "IsolatedRunner", "death_failure", "replay_isolated"]
