"""The child side of :mod:`reprokit.isolation`: a fork server that imports torch and reprokit once, then runs each
replay attempt it is asked for in a forked process of its own and reports the attempt's events, exit status and peak
memory to the parent on a pipe. It also runs a whole ``python -m reprokit ARGS`` command from a folder in a forked
process (:meth:`reprokit.isolation.IsolatedRunner.run_command`). Run as ``python -m reprokit.isolation_server FD``; it
never runs user code itself.
"""

from __future__ import annotations

import atexit
import faulthandler
import importlib.machinery
import json
import os
import runpy
import signal
import sys
from typing import IO, Any

from reprokit import errors
from reprokit.bundle import open_bundle
from reprokit.replayer import Session

# -- the child ----------------------------------------------------------------------------------------------------

def _send(fd: int, event: dict[str, Any]) -> None:
    data = (json.dumps(event) + "\n").encode()
    while data:  # a pipe takes a large write in parts
        data = data[os.write(fd, data):]


def _attempt(fd: int, req: dict[str, Any]) -> None:
    """Run one attempt in this (forked) process: the events of its steps, then its result or the error that stopped
    it. A death by an uncaught ``BaseException`` (``SystemExit`` from the step) is said before the process goes."""
    _send(fd, {"event": "forked", "pid": os.getpid()})
    try:
        s = Session(open_bundle(req["bundle"]), device=req["device"], code=req["code"], preload=True)
        s.__enter__()
    except errors.ReprokitError as e:
        _send(fd, {"event": "error", "error": type(e).__name__, "message": str(e),
                   "attributes": {k: getattr(e, k) for k in ("problems", "cli_message") if hasattr(e, k)}})
        return
    s.on_step = lambda what, step, loss: _send(fd, {"event": what, "step": step, "loss": loss})
    found = None
    try:
        if req.get("triage"):
            from reprokit.triage import watched_run

            out, found = watched_run(s)
        else:
            out = s.run(s.inputs())
    except BaseException as e:  # SystemExit, KeyboardInterrupt from the step: a Python-level death
        _send(fd, {"event": "died", "exc_type": type(e).__qualname__,
                   "message": str(e).splitlines()[0][:500] if str(e) else ""})
        sys.stderr.flush()
        os._exit(70)
    _send(fd, {"event": "result", "failure": out.failure.to_json() if out.failure else None, "same": out.same,
               "losses": list(out.losses.items()), "seconds": out.seconds, "device": str(s.device),
               "code": s.code_label, "same_device": s.same_device(), "triage": found})
    s.__exit__(None, None, None)
    s.drop_code_copy()


_CWD_ENTRY: str | None = None
"""The entry ``python -m`` put first on the server's ``sys.path`` for its working directory (None under ``-P``)."""


def _command(fd: int, req: dict[str, Any]) -> None:
    """Run ``python -m reprokit ARGV`` from the folder ``cwd`` in this (forked) process, as a fresh process started
    there would, less the imports: the folder first on ``sys.path`` in place of the server's own, standard output and
    error to the files named, nothing to read on standard input, no ``faulthandler`` unless asked for
    (``PYTHONFAULTHANDLER``), ``atexit`` handlers run at the end. Where the folder holds a module the server has
    imported (its own ``reprokit``, a ``profile.py``), a fresh process would import the folder's: this process then
    becomes a fresh ``python -m reprokit`` (exec), so the command always runs the folder's code. The process leads a
    process group of its own (the parent kills the group at its time limit: what the command started goes with it)
    and is killed when the server goes. Never returns: the process exits with the command's status."""
    code = 1
    try:
        _die_with_parent(req["server"])
        os.setpgid(0, 0)
        _send(fd, {"event": "forked", "pid": os.getpid()})
        os.close(fd)  # the server's end of the events pipe: the parent reads end of file once the server is gone
        for target, path, flags in ((0, os.devnull, os.O_RDONLY),
                                    (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                    (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            f = os.open(path, flags, 0o600)
            os.dup2(f, target)
            os.close(f)
        os.chdir(req["cwd"])
        if _CWD_ENTRY is not None and sys.path and sys.path[0] == _CWD_ENTRY:
            sys.path[0] = os.getcwd()  # what ``python -m`` puts first when started in this folder
            if _shadowed(sys.path[0]):
                os.execv(sys.executable, [sys.executable, "-m", "reprokit", *req["argv"]])
        if not os.environ.get("PYTHONFAULTHANDLER"):
            faulthandler.disable()
        sys.argv = ["-m", *req["argv"]]  # run_module sets argv[0] to reprokit's __main__.py, as ``python -m`` does
        try:
            runpy.run_module("reprokit", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:  # what the interpreter makes of it at exit
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:  # an uncaught exception: reported as the interpreter does, exit status 1
            sys.excepthook(*sys.exc_info())
            code = 1
        atexit._run_exitfuncs()
    except BaseException:  # reprokit's own fault before the command ran (the folder gone, say): said, exit status 1
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code & 0xFF)


def _shadowed(folder: str) -> list[str]:
    """The modules this process has imported (top-level names) of which ``folder`` holds its own: a module file,
    an extension or a folder of that name. A fresh interpreter with ``folder`` first on ``sys.path`` would import
    those from there. Built-in and frozen modules never come from a folder."""
    suffixes = tuple(importlib.machinery.all_suffixes())
    names = set()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        if entry.name.endswith(suffixes):
            names.add(entry.name.split(".", 1)[0])
        elif entry.is_dir() and entry.name.isidentifier():
            names.add(entry.name)
    out = []
    for name in sorted(names):
        module = sys.modules.get(name)
        if module is None or name in sys.builtin_module_names:
            continue
        spec = getattr(module, "__spec__", None)
        if spec is not None and spec.origin in ("built-in", "frozen"):
            continue
        out.append(name)
    return out


def _die_with_parent(server: int) -> None:
    """Have the kernel kill this process when the server (pid ``server``) goes (Linux; elsewhere nothing), so no
    command outlives a server that was killed while it ran."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != server:  # the server went before the request took
        os._exit(1)


def _serve(fd: int, requests: IO[str]) -> None:
    """The fork server: one forked process per request, waited for; its exit status and peak memory reported."""
    _send(fd, {"event": "ready", "pid": os.getpid()})
    for line in requests:
        req = json.loads(line)
        if "argv" in req:
            import reprokit.cli  # noqa: F401 - once here rather than in each command's process (no user code)
        sys.stdout.flush()  # nothing of the server's own buffered output may end in a forked process's files
        sys.stderr.flush()
        req["server"] = os.getpid()
        pid = os.fork()
        if pid == 0 and "argv" in req:
            _command(fd, req)
        if pid == 0:
            code = 0
            try:
                _attempt(fd, req)
            except BaseException as e:  # reprokit's own fault in the attempt: said as a death, never a hang
                _send(fd, {"event": "died", "exc_type": type(e).__qualname__, "message": str(e)[:500]})
                code = 70
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status, usage = os.wait4(pid, 0)
        _send(fd, {"event": "exit", "returncode": os.waitstatus_to_exitcode(status),
                   "peak_rss_bytes": usage.ru_maxrss * 1024})  # kB on Linux


def _preload() -> None:
    """Import what every replay imports lazily, once in the server rather than in each attempt: setting the
    determinism flags imports torch._dynamo and torch._inductor (seconds). The server runs no torch op, so torch's
    intra-op pool (OpenMP) never starts here: a fork copies no lock one of its threads holds. (numpy's OpenBLAS may
    start a pool at import, where more than one thread is allowed; it shuts that pool down itself before each fork.)
    tests/integration/test_isolated_commands.py checks the server has one thread after its forks."""
    import torch._dynamo  # noqa: F401
    import torch._inductor  # noqa: F401


def main(argv: list[str]) -> None:
    """``python -m reprokit.isolation_server FD``: serve replay requests (JSON lines on stdin), events on file FD."""
    global _CWD_ENTRY

    if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] == os.getcwd():  # no -P (3.11+)
        _CWD_ENTRY = sys.path[0]
    fd = int(argv[0])
    os.set_inheritable(fd, False)  # programs the step runs (exec) must not keep the parent's end-of-file away
    faulthandler.enable(all_threads=True)  # a segfault's Python traceback goes to the log the parent keeps
    import reprokit.replayer  # noqa: F401 - torch and reprokit before "ready": the start-up cost is the server's own
    _preload()
    _serve(fd, sys.stdin)


if __name__ == "__main__":
    main(sys.argv[1:])
