"""Training scripts (and ``python -m reprokit`` commands) run as real processes without a torch import each: forked
from a server that imported torch once.

Importing torch costs seconds (tens on a loaded 2-core CI machine), and the durable-recording tests start a training
process per case (20 for the random kill points alone). :class:`ForkedRuns` starts ``python tests/rk_forked.py``
once: it imports torch and reprokit, starts no thread (checked) and forks one process per run, which chdirs, sets
its environment and ``sys.argv`` and runs the script as ``__main__`` (``runpy.run_path``, as ``python train.py``
does) or a module as ``python -m`` does (``runpy.run_module``, the working directory first on ``sys.path``). The run
is a real process: it records, dies by its own signal or is SIGKILLed from the test by its pid; the server waits for
it and reports its exit status as ``subprocess`` would (``-9`` for SIGKILL). This is what ``reprokit.isolation`` does
for replays. Nothing a run imports (an example's modules, a bundle's code) is ever in the server: each run starts from
the same clean state. What a fork cannot give is a fresh interpreter's start-up (``PYTHONPATH`` read at start, the
imports of a process that never imported torch): tests about those keep ``subprocess``.

The ``fork_server`` fixture (tests/conftest.py) is one server per test process, shared by every test that takes it.
:func:`shared_bare` is the same for the hand-off runs (``python -S`` with only torch, numpy and safetensors): a
``python -S`` server that imported torch alone, its runs with the import path of a fresh ``python -S`` run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]


def end_server(proc: subprocess.Popen) -> None:
    """Stop a server that serves until its standard input closes (this module's, rk_ranks'): close it, give the server
    30 s to end (its runs still going are its to end), else kill it."""
    if proc.stdin:
        proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout:
        proc.stdout.close()


class ForkedRuns:
    """A fork server for training scripts. Use as a context manager (the server stops at the end).

    Example:
        >>> with ForkedRuns() as runs:                                   # doctest: +SKIP
        ...     runs.run("train.py", ["out", "37"], cwd=tmp, env={"DIE_HOW": "segv"})
        -11
    """

    def __init__(self, env: dict[str, str] | None = None, bare: bool = False) -> None:
        """``env``: the server's environment (default: this process's). ``bare``: the server runs as ``python -S``
        and imports torch alone, with nothing on its import path but the standard library and ``env``'s
        ``PYTHONPATH``: a run forked from it imports what ``python -S SCRIPT`` started with that environment could
        import, and nothing more (e.g. a packed repro with only torch, numpy and safetensors: :func:`shared_bare`)."""
        here = str(Path(__file__).resolve())
        argv = [sys.executable, "-S", here, "--bare"] if bare else [sys.executable, here]
        self._proc = subprocess.Popen(argv, cwd="/" if bare else ROOT, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._busy = threading.Lock()  # one run at a time: the server answers on one pipe (see _claim)
        ready = self._read()
        assert ready.get("threads") == 1, f"the fork server has {ready.get('threads')} threads: forking is unsafe"

    def __enter__(self) -> ForkedRuns:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        end_server(self._proc)

    def _read(self) -> dict[str, Any]:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server died (exit {self._proc.wait()})")
        return json.loads(line)

    def start(self, script: Path | None, argv: list[str], *, cwd: Path, env: dict[str, str] | None = None,
              log: Path | None = None, module: str | None = None, replace_env: bool = False,
              new_session: bool = False) -> int:
        """Fork a run of ``script`` (or of ``python -m module`` when ``script`` is None) with ``argv``; its pid (the
        caller may signal it). Its stdout and stderr go to ``log`` (default: ``cwd/run.log``). ``env`` and
        ``replace_env`` as for :meth:`capture`; ``new_session``: the run starts a session (and process group) of its
        own, as ``subprocess.Popen(start_new_session=True)`` does, so the caller can kill the group. Call :meth:`wait`
        before the next :meth:`start`."""
        assert self._proc.stdin is not None
        assert (script is None) != (module is None), "a script or a module"
        req = {"script": str(script) if script else None, "module": module, "argv": [str(a) for a in argv],
               "cwd": str(cwd), "env": env or {}, "replace_env": replace_env, "new_session": new_session,
               "log": str(log or Path(cwd) / "run.log")}
        self._claim()
        self._proc.stdin.write(json.dumps(req) + "\n")
        self._proc.stdin.flush()
        return int(self._read()["pid"])

    def _claim(self) -> None:
        """Refuse a second run while one is out (another thread's, or a :meth:`start` not yet waited for): the
        server forks and reaps one run at a time and answers on one pipe, so two would read each other's lines."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this fork server has a run out: wait() for it first (one run at a time, one thread)")

    def wait(self) -> int:
        """The exit status of the run :meth:`start` forked, as ``subprocess`` gives it (``-N``: killed by signal N)."""
        try:
            return int(self._read()["returncode"])
        finally:
            self._busy.release()

    def run(self, script: Path, argv: list[str], *, cwd: Path, env: dict[str, str] | None = None) -> int:
        """:meth:`start` then :meth:`wait`."""
        self.start(script, argv, cwd=cwd, env=env)
        return self.wait()

    def capture(self, argv: list[Any], *, cwd: Path | str, script: Path | None = None, module: str | None = None,
                env: dict[str, str] | None = None, replace_env: bool = False,
                timeout: float = 600) -> subprocess.CompletedProcess:
        """Run ``python SCRIPT ARGV`` or ``python -m MODULE ARGV`` from ``cwd`` in a forked process, stdin empty,
        and return what ``subprocess.run(..., capture_output=True, text=True)`` would: ``returncode``, ``stdout``,
        ``stderr``. ``env``: variables set on top of the server's environment, or the whole environment with
        ``replace_env`` (as ``subprocess.run(env=...)``; what the process starts gets exactly that). Past ``timeout``
        seconds the process is killed (``returncode`` -9, and its stderr says so)."""
        assert (script is None) != (module is None), "a script or a module"
        assert self._proc.stdin is not None
        out = Path(tempfile.mkdtemp(prefix="rk-forked-"))
        try:
            req = {"script": str(script) if script else None, "module": module, "argv": [str(a) for a in argv],
                   "cwd": str(cwd), "env": env or {}, "replace_env": replace_env, "stdout": str(out / "stdout"),
                   "stderr": str(out / "stderr")}
            self._claim()
            self._proc.stdin.write(json.dumps(req) + "\n")
            self._proc.stdin.flush()
            pid, fired = int(self._read()["pid"]), []

            def kill() -> None:
                fired.append(True)
                os.kill(pid, signal.SIGKILL)

            killer = threading.Timer(timeout, kill)
            killer.start()
            try:
                code = self.wait()
            finally:
                killer.cancel()
            cmd = [sys.executable, *([str(script)] if script else ["-m", str(module)]), *req["argv"]]
            stdout, stderr = (_text(out / name) for name in ("stdout", "stderr"))
            if fired:
                stderr += f"\n(killed after {timeout:g}s)"
            return subprocess.CompletedProcess(cmd, code, stdout, stderr)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def reprokit(self, *args: Any, cwd: Path | str = "/", env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess:
        """``python -m reprokit ARGS`` from ``cwd``, forked (see :meth:`capture`)."""
        return self.capture(list(args), cwd=cwd, module="reprokit", env=env)


_SHARED: ForkedRuns | None = None


def shared() -> ForkedRuns:
    """This test process's fork server, started at the first call (this process's environment, this checkout first
    on ``PYTHONPATH``) and stopped when the process exits; the ``fork_server`` fixture, ``rk_testing.torchrun`` and
    test_fail_fast's launcher use it."""
    global _SHARED
    if _SHARED is None or _SHARED._proc.poll() is not None:
        import atexit

        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        _SHARED = ForkedRuns(env=env)
        atexit.register(_SHARED.close)
    return _SHARED


_SHARED_BARE: ForkedRuns | None = None


def hand_off_env(site: Path, home: Path) -> dict[str, str]:
    """A colleague's environment with only torch, numpy and safetensors installed, for a ``python -S`` hand-off run
    (fresh, or forked from :func:`shared_bare` with ``replace_env=True``): this machine's ``PATH``, the minimal
    ``site`` as the whole ``PYTHONPATH``, ``home`` as ``HOME``; nothing else."""
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(site), "HOME": str(home)}


def shared_bare() -> ForkedRuns:
    """This test process's bare fork server (``ForkedRuns(bare=True)``), started at the first call and stopped when
    the process exits: ``python -S`` with only a minimal site (:func:`rk_testing.minimal_site`: torch, numpy,
    safetensors and their requirements) on ``PYTHONPATH``, which is its ``site`` attribute. A hand-off run is
    ``capture(..., env={"PYTHONPATH": str(server.site), ...}, replace_env=True)``: what ``python -S SCRIPT`` run
    with that environment imports, without its own torch import."""
    global _SHARED_BARE
    if _SHARED_BARE is None or _SHARED_BARE._proc.poll() is not None:
        import atexit

        from rk_testing import minimal_site

        top = Path(tempfile.mkdtemp(prefix="rk-bare-site-"))
        site = minimal_site(top / "site")
        server = ForkedRuns(env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(site)}, bare=True)
        server.site = site  # type: ignore[attr-defined]
        atexit.register(shutil.rmtree, top, ignore_errors=True)
        atexit.register(server.close)  # first out: the server stops, then its site goes
        _SHARED_BARE = server
    return _SHARED_BARE


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:  # the process died before it opened its output
        return ""


def _child(req: dict[str, Any]) -> None:
    import atexit
    import runpy
    import tempfile

    code = 0
    try:
        if req.get("new_session"):
            os.setsid()
        if not req.get("streams_ready"):  # (rk_ranks gives its ranks their stand-in's streams itself)
            fd = os.open(os.devnull, os.O_RDONLY)  # never the server's requests
            os.dup2(fd, 0)
            os.close(fd)
            for target, path in ((1, req.get("stdout") or req["log"]), (2, req.get("stderr") or req["log"])):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, target)
                os.close(fd)
        os.chdir(req["cwd"])
        if req.get("replace_env"):
            os.environ.clear()
        os.environ.update(req["env"])
        # What a fresh interpreter reads from its environment at start-up, read again: the temporary folder, the
        # thread count (torch is imported, its thread pool not yet started), the fault handler.
        tempfile.tempdir = None
        if "OMP_NUM_THREADS" in req["env"]:
            import torch

            torch.set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))
        if os.environ.get("PYTHONFAULTHANDLER"):
            import faulthandler

            faulthandler.enable()
        if req.get("module"):
            sys.argv = ["-m", *req["argv"]]  # run_module puts the module's file there, as ``python -m`` does
            sys.path[0] = os.getcwd()  # in place of the server's script folder: what ``python -m`` puts first
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = [req["script"], *req["argv"]]
            sys.path[0] = os.path.dirname(os.path.abspath(req["script"]))  # as ``python SCRIPT`` puts it first
            runpy.run_path(req["script"], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        sys.excepthook(*sys.exc_info())  # as the interpreter reports an uncaught exception (notes included)
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter runs at a normal exit (a recorder's flight log closes there)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code & 0xFF)


def _serve(requests: IO[str]) -> None:
    print(json.dumps({"threads": threading.active_count()}), flush=True)
    for line in requests:
        req = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--bare"]:  # python -S: torch (and what it imports) alone, see ForkedRuns(bare=True)
        # Not this script's folder (tests/) on the path while torch imports: only PYTHONPATH and the standard
        # library. Each run puts its own script's folder first (_child), in this placeholder's place.
        sys.path.pop(0)
        import torch  # noqa: F401

        sys.path.insert(0, "")

        _serve(sys.stdin)
        raise SystemExit(0)
    import git  # noqa: F401 - gitpython, which every recording's code snapshot imports (git_info)
    import torch  # noqa: F401 - once, here: every run forked from this process has it
    import torch._dynamo  # noqa: F401 - imported lazily by the recorder's determinism flags

    import reprokit  # noqa: F401
    import reprokit.cli  # noqa: F401 - what ``python -m reprokit`` imports first
    import reprokit.replayer  # noqa: F401

    _serve(sys.stdin)
