"""Replays that may kill the process, run in a child process.

A step that segfaults in an extension, calls ``abort()``, is killed by a signal or poisons the CUDA context would
take reprokit down with it. :class:`IsolatedRunner` runs each replay attempt in a child (``python -m
reprokit.isolation``) that runs the ordinary :class:`~reprokit.replayer.Session`, and tells its parent on a pipe as
each step starts and finishes, then the run's outcome. When the child dies instead, the parent knows the step it
died in (the last one started) and how (the signal, from its exit status), and makes of that a ``crash`` failure,
judged against the recorded one like any other (:func:`reprokit.signature.same_failure`).

Importing torch costs seconds, and an attempt that dies would cost a fresh child each time (a shrink of a crash
bundle kills one per interesting candidate). So the child started by ``python -m reprokit.isolation`` is a *fork
server*, as multiprocessing's "forkserver" context is: it imports torch and reprokit, runs nothing of the user's, never
touches a GPU, and forks one process per attempt, which it waits for and whose end (exit status, peak memory) it
reports. The attempt's process is the one that may die; the fork server and reprokit go on. Forking is safe there
because the server runs no torch op (torch's thread pool never starts there) and has no device context: the attempt
starts as a fresh process would, less the imports. Should the server itself die, the next attempt starts another.
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
from typing import Any

from reprokit import errors
from reprokit.outcome import RunOutcome
from reprokit.signature import Failure

STARTUP_LIMIT_S = 600.0
"""Seconds a child may take to import torch and reprokit before the runner gives up on it."""
LOG_TAIL_LINES = 20
"""Lines of a dead child's output (its ``faulthandler`` traceback, a CUDA error) kept in its death record."""
KILLED_FROM_OUTSIDE = ("the process was killed from outside (SIGKILL with no error recorded): likely the OOM killer "
                       "or the scheduler")
STOPPED_FROM_OUTSIDE = ("the process was stopped from outside (SIGTERM): the scheduler or torchrun stopping the job, or "
                        "its launcher after another rank died")
FROM_OUTSIDE = {None: KILLED_FROM_OUTSIDE, "SIGKILL": KILLED_FROM_OUTSIDE, "SIGTERM": STOPPED_FROM_OUTSIDE}
"""The note for a recorded crash (by its ``exc_type``) that replays clean: a death that came from outside the step."""


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
    triage: dict[str, Any] | None = None
    """For a triage request (``attempt(triage=True)``): what :func:`reprokit.triage.watched_run` found."""


@dataclass
class CommandRun:
    """A ``python -m reprokit ARGS`` command run in a process forked by the server
    (:meth:`IsolatedRunner.run_command`): its exit status (negative: killed by that signal; None: killed past its time
    limit) and what it wrote on its standard output and error."""

    returncode: int | None
    stdout: str
    stderr: str

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


@dataclass
class _Child:
    proc: subprocess.Popen
    events: int
    log: Path
    started: float
    buf: bytearray = field(default_factory=bytearray)
    ready: bool = False


class IsolatedRunner:
    """Replay attempts, one at a time, each in a process of its own forked by a fork server (see the module
    docstring); the server is started at the first attempt, and again after one that killed it.

    Use as a context manager: the server is stopped at the end, the scratch folder removed.

    Example:
        >>> with IsolatedRunner() as runner:                                        # doctest: +SKIP
        ...     a = runner.attempt(bundle.path, recorded=bundle.failure)
        ...     a.outcome.verdict, a.outcome.death
        ('reproduced', {'signal': 'SIGSEGV', 'step': 37, ...})
    """

    def __init__(self, env: dict[str, str] | None = None, *, empty_cwd: bool = False) -> None:
        """``env``: variables set in the children's environment (``CUDA_VISIBLE_DEVICES=""``: they see no GPU).
        ``empty_cwd``: run the fork server in an empty folder of its own rather than in this process's working
        directory, so that no module of the caller's folder can be imported there (the folder ``python -m`` puts
        first on ``sys.path``); :meth:`run_command` wants that."""
        from reprokit.code import child_env

        self._tmp = Path(tempfile.mkdtemp(prefix="reprokit-isolate-"))
        root = str(Path(__file__).resolve().parent.parent)  # this reprokit, whatever the child's path says
        env = {**child_env(self._tmp), **(env or {})}  # the children's code copies go to the scratch: removed with it
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        self._env = env
        self.empty_cwd = empty_cwd
        self._cwd: Path | None = None
        if empty_cwd:
            self._cwd = self._tmp / "cwd"
            self._cwd.mkdir()
        self._child: _Child | None = None
        self.starts = 0
        """Fork servers started (one, unless one died)."""
        self.attempts = 0
        """Attempts run, each in a process of its own forked by the server."""
        self.deaths = 0
        """Attempts whose process died (or was killed for running past its limit)."""
        self.startup_seconds = 0.0
        """Summed over the fork servers: from their start until they were ready (python, torch, reprokit imported)."""
        self.waited_seconds = 0.0
        """Of that, the time the caller waited for a server to be ready."""

    def __enter__(self) -> IsolatedRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the fork server (it leaves when its input closes; killed if not within 5 s); remove the scratch."""
        child, self._child = self._child, None
        if child is not None:
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
        """What isolation cost: fork servers started and their start-up time (and how much of it was waited for),
        attempts run and how many of them died."""
        return {"child_starts": self.starts, "attempts": self.attempts, "child_deaths": self.deaths,
                "startup_seconds": round(self.startup_seconds, 3), "waited_seconds": round(self.waited_seconds, 3)}

    def attempt(self, bundle: str | Path, *, recorded: Failure, device: str | None = None,
                code: str | Path | None = None, timeout: float | None = None, triage: bool = False) -> Attempt:
        """Replay ``bundle``'s window once in a child; judge a death against ``recorded`` (the bundle's failure).
        ``triage``: watch the failing step's indexing ops (:func:`reprokit.triage.watched_run`; ``Attempt.triage``).

        Raises:
            ReprokitError: the child could not replay the bundle (the error the replay raised there, such as a
                :class:`~reprokit.errors.CodeLoadError`, of the same class), or could not start at all.
        """
        child = self._ready_child()
        request = {"bundle": str(bundle), "device": device, "code": str(code) if code is not None else None,
                   "triage": triage}
        started: list[int] = []
        finished: dict[int, float | None] = {}
        got: dict[str, dict[str, Any]] = {}  # the attempt's last word: result, error or died; its process's exit
        t0 = time.perf_counter()
        deadline = None if timeout is None else t0 + timeout
        offset = child.log.stat().st_size  # this attempt's output starts here
        self.attempts += 1
        _send(child, request)
        while "exit" not in got:
            event = self._next_event(child, deadline)
            if event is None:  # the server itself died (killed from outside): so did the attempt
                return self._server_died(child, recorded, got, started, finished, time.perf_counter() - t0)
            if event["event"] == "timeout":
                if "forked" not in got:
                    return self._killed(child)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(got["forked"]["pid"], signal.SIGKILL)  # the server reports its exit next
                got["timeout"], deadline = event, None
            elif event["event"] == "started":
                started.append(event["step"])
            elif event["event"] == "finished":
                finished[event["step"]] = event["loss"]
            else:
                got[event["event"]] = event
        end = got["exit"]
        if "timeout" in got:
            self.deaths += 1
            return Attempt(None, peak_rss_bytes=end["peak_rss_bytes"], timed_out=True)
        if "error" in got:
            raise _error_of(got["error"])
        if "result" in got:  # a process that dies after its result (a poisoned CUDA context at exit) ran the window
            return _attempt_of(got["result"], end["peak_rss_bytes"])
        self.deaths += 1
        tail = _tail(child.log, offset)
        pid = got["forked"]["pid"] if "forked" in got else child.proc.pid
        failure = death_failure(end["returncode"], got.get("died"), started, finished, tail, pid)
        return died(failure, recorded, finished, time.perf_counter() - t0, end["peak_rss_bytes"])

    def run_command(self, argv: list[str], *, cwd: str | Path, timeout: float | None = None) -> CommandRun:
        """Run ``python -m reprokit ARGV`` from the folder ``cwd`` in a process forked by the server, as a fresh
        process started there would run it, less the seconds of importing torch: ``cwd`` first on ``sys.path`` (in
        place of the server's folder), stdin empty, stdout and stderr captured, its exit status returned. Nothing of
        what the command imports (user code) stays: the server never imports it, and the process goes at the end.
        Where ``cwd`` holds a module the server imported (its own ``reprokit``, say: a checkout of a project that
        vendors it, or of reprokit itself), a fresh interpreter would import that one: the forked process then execs
        a fresh ``python -m reprokit``, so the command runs the folder's code either way. Past ``timeout`` seconds the
        command is killed with every process it started (its process group; ``returncode`` None); so it is when the
        call is interrupted, and a command whose server is killed dies with it.

        Example:
            >>> with IsolatedRunner(empty_cwd=True) as runner:                                     # doctest: +SKIP
            ...     run = runner.run_command(["replay", "bundle-x", "--json"], cwd="/tmp/checkout", timeout=600)
            >>> run.returncode, run.stdout                                                          # doctest: +SKIP
            (1, '{"verdict": "deterministic", ...}')
        """
        child = self._ready_child()
        n = self.attempts
        out, err = self._tmp / f"command-{n}.out", self._tmp / f"command-{n}.err"
        request = {"argv": [str(a) for a in argv], "cwd": str(Path(cwd).resolve()), "stdout": str(out),
                   "stderr": str(err)}
        deadline = None if timeout is None else time.perf_counter() + timeout
        self.attempts += 1
        got: dict[str, dict[str, Any]] = {}
        _send(child, request)
        returncode: int | None
        try:
            while True:
                event = self._next_event(child, deadline)
                if event is None:  # the server itself died (killed from outside): so did the command
                    rc, _ = self._reap(child)
                    self._child = None
                    returncode = rc if rc < 0 else -signal.SIGKILL
                    break
                if event["event"] == "timeout" and "forked" not in got:  # the server goes; the next call starts another
                    self._killed(child)  # counts the death; the kernel kills a command already forked with it
                    returncode = None
                    break
                if event["event"] == "timeout":
                    _kill_group(got["forked"]["pid"])  # the server reports its exit next
                    got["timeout"], deadline = event, None
                elif event["event"] == "exit":
                    returncode = None if "timeout" in got else event["returncode"]
                    break
                else:
                    got[event["event"]] = event
        except BaseException:  # interrupted (Ctrl-C): nothing of the command's may outlive the call
            if "forked" in got:
                _kill_group(got["forked"]["pid"])
            if self._child is child:
                self._killed(child)
            raise
        if event is None or (event["event"] == "exit" and (returncode is None or returncode < 0)):
            self.deaths += 1
        texts = []
        for f in (out, err):
            try:
                texts.append(f.read_text(errors="replace"))
                f.unlink()
            except OSError:
                texts.append("")
        return CommandRun(returncode, texts[0], texts[1])

    # -- children ------------------------------------------------------------------------------------------------

    def _spawn(self) -> _Child:
        read, write = os.pipe()
        log = self._tmp / f"child-{self.starts}.log"
        try:
            with open(log, "wb") as out:
                proc = subprocess.Popen([sys.executable, "-m", "reprokit.isolation_server", str(write)], stdin=subprocess.PIPE,
                                        stdout=out, stderr=subprocess.STDOUT, pass_fds=(write,), env=self._env,
                                        text=True, cwd=self._cwd)
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
            self._child = self._spawn()
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

    def _killed(self, child: _Child) -> Attempt:
        """Past the time limit before the attempt's process said its pid: the server goes (the next attempt starts
        another)."""
        child.proc.kill()
        _, peak = self._reap(child, 0.0)
        self.deaths += 1
        self._child = None
        return Attempt(None, peak_rss_bytes=peak, timed_out=True)

    def _server_died(self, child: _Child, recorded: Failure, got: dict[str, dict[str, Any]], started: list[int],
                     finished: dict[int, float | None], seconds: float) -> Attempt:
        rc, peak = self._reap(child)  # its pipe closed: it is leaving
        self.deaths += 1
        self._child = None  # the next attempt starts another
        tail = _tail(child.log)
        pid = got["forked"]["pid"] if "forked" in got else child.proc.pid
        failure = death_failure(rc, got.get("died"), started, finished, tail, pid)
        return died(failure, recorded, finished, seconds, peak)


def _send(child: _Child, request: dict[str, Any]) -> None:
    """One request line to the fork server (a server that died since it said it was ready: the events pipe says so
    next, so nothing is raised here)."""
    try:
        assert child.proc.stdin is not None
        child.proc.stdin.write(json.dumps(request) + "\n")
        child.proc.stdin.flush()
    except OSError:
        pass


def _kill_group(pid: int) -> None:
    """Kill the process group that the command process ``pid`` leads: the command and what it started (a replay's
    own fork server, a data loader's workers), unless they left the group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def died(failure: Failure, recorded: Failure, finished: dict[int, float | None], seconds: float,
         peak: int | None) -> Attempt:
    """The attempt whose process died with ``failure`` (see :func:`death_failure`), judged against ``recorded``;
    ``finished``: the losses of the steps it finished. Also used for a rank of an incident replay that died."""
    tail = failure.detail["fault_log"]
    death = {"signal": failure.detail["signal"], "returncode": failure.detail["returncode"], "step": failure.step,
             "where": fault_frame(tail), "last_started": failure.detail["last_started"],
             "last_finished": failure.detail["last_finished"], "peak_rss_bytes": peak, "output_tail": tail}
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


def _attempt_of(event: dict[str, Any], peak: int | None) -> Attempt:
    failure = Failure.from_json(event["failure"]) if event["failure"] else None
    losses = {int(k): v for k, v in event["losses"]}
    outcome = RunOutcome(failure, event["same"], losses, event["seconds"])
    return Attempt(outcome, event["device"], event["code"], event["same_device"], peak, triage=event.get("triage"))


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


def _tail(log: Path, offset: int = 0) -> str:
    """The last lines of ``log`` written after ``offset``."""
    try:
        with open(log, "rb") as f:
            f.seek(max(offset, f.seek(0, os.SEEK_END) - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-LOG_TAIL_LINES:])


# -- the parent side of replay ------------------------------------------------------------------------------------

def isolation_summary(report: Any, attempts: list[Attempt], cost: dict[str, Any],
                      env: dict[str, Any]) -> dict[str, Any]:
    """``report.isolation``: the cost, the death that the verdict rests on, peak memory, and the note for a crash
    with no error recorded that replayed clean."""
    recorded = report.recorded
    deaths = [r.death for r in report.runs if r.death]
    death = next((r.death for r in report.runs if r.same and r.death), deaths[0] if deaths else None)
    peaks = [a.peak_rss_bytes for a in attempts if a.peak_rss_bytes]
    note = None
    if recorded.kind == "crash" and report.verdict == "not_reproduced":
        note = FROM_OUTSIDE.get(recorded.exc_type)
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
    line = (f"  isolation: each run in a process of its own ({iso['child_deaths']} of {iso['attempts']} died), forked by "
            f"a server that imported torch once ({iso['startup_seconds']:.1f}s)")
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


__all__ = ["FROM_OUTSIDE", "KILLED_FROM_OUTSIDE", "STOPPED_FROM_OUTSIDE", "Attempt", "CommandRun", "IsolatedRunner",
           "death_failure", "died"]
