"""torchrun's ranks without a torch import each: every rank forked from a server that imported torch once.

A rank under ``python -m torch.distributed.run`` is a fresh interpreter that imports torch and reprokit (seconds each;
two per launch, and the suite launches torchrun some thirty times). :func:`torchrun_argv` has torchrun start, in each
rank's place, a stand-in (``python -S tests/rk_ranks.py SCRIPT ARGS``: the standard library alone, milliseconds) that
hands its standard streams, working folder, environment (what torchrun gave the rank: ``RANK``, ``MASTER_PORT``...)
and arguments to this test process's rank server over a Unix socket. The server (``python tests/rk_ranks.py --serve``:
torch, gitpython and reprokit imported, one thread) forks the rank, which runs the script as ``__main__`` exactly as
a :class:`rk_forked.ForkedRuns` run does, in a session of its own (as torchrun starts its workers), its output
unbuffered (torchrun runs ``python -u``). The stand-in stays what torchrun watches: it passes on the signals torchrun
sends (SIGTERM when another rank failed), and ends as the rank ended (its exit code, or killed by the same signal).
When the stand-in dies (SIGKILLed by torchrun or a test), the server SIGKILLs its rank: none outlives its launch.

The same stand-in, ``python -S tests/rk_ranks.py -m reprokit ARGS`` (:func:`stand_in`), is the ``python -m reprokit``
that a test's ``git bisect run`` starts at each commit.

What a fork cannot give is a fresh interpreter's start-up: a test about a rank's own imports or start keeps fresh
ranks (:func:`rk_testing.torchrun` with ``fresh_ranks=True``).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
SERVER_VAR = "RK_RANK_SERVER"
"""The stand-in's environment variable that names the server's socket (removed from the rank's environment)."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


class RankServer:
    """``python tests/rk_ranks.py --serve SOCKET`` with ``env`` (its import path is the ranks'); stopped by
    :meth:`close` (every rank still running is SIGKILLed)."""

    def __init__(self, env: dict[str, str]) -> None:
        self._dir = tempfile.mkdtemp(prefix="rk-ranks-", dir="/tmp" if os.path.isdir("/tmp") else None)
        self.socket = os.path.join(self._dir, "s")  # short: a Unix socket's path has at most 107 bytes
        self._proc = subprocess.Popen([sys.executable, str(HERE), "--serve", self.socket], env=env, cwd="/",
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        ready = json.loads(self._proc.stdout.readline() or "{}")
        assert ready.get("threads") == 1, f"the rank server has {ready.get('threads')} threads: forking is unsafe"

    def alive(self) -> bool:
        return self._proc.poll() is None

    def close(self) -> None:
        import shutil

        from rk_forked import end_server

        end_server(self._proc)
        shutil.rmtree(self._dir, ignore_errors=True)


_SHARED: dict[str, RankServer] = {}
_LOCK = threading.Lock()


def shared(env: dict[str, str]) -> RankServer:
    """This test process's rank server for ``env``'s ``PYTHONPATH`` (the ranks' import path), started at the first
    call and stopped when the process exits. The server's own environment is ``env`` less ``PYTHONFAULTHANDLER``:
    each rank turns the fault handler on from its own environment, as a fresh interpreter does."""
    path = env.get("PYTHONPATH", "")
    with _LOCK:
        server = _SHARED.get(path)
        if server is None or not server.alive():
            import atexit

            server = _SHARED[path] = RankServer({k: v for k, v in env.items() if k != "PYTHONFAULTHANDLER"})
            atexit.register(server.close)
        return server


def stand_in(env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """``(["python", "-S", "tests/rk_ranks.py"], env with the server's socket)``: the command that, followed by
    ``SCRIPT ARGS`` or ``-m MODULE ARGS``, runs as ``python SCRIPT ARGS`` (``python -m MODULE ARGS``) would, forked
    from :func:`shared` ``(env)``: for a command a tool starts (torchrun's ranks, ``git bisect run``'s)."""
    return [sys.executable, "-S", str(HERE)], {**env, SERVER_VAR: shared(env).socket}


def forks_ranks() -> bool:
    """Whether tests fork torchrun's ranks here: on a CPU-only machine. On a machine with a CUDA device the ranks
    stay fresh processes, as the GPU tests were verified with them."""
    import torch

    return not torch.cuda.is_available()


def torchrun_argv(script: Path | str, args: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """torchrun's arguments from the script on (``--no-python`` and the stand-in, then ``script ARGS``) and the
    launcher's environment (``env`` with the server's socket), for ranks forked from :func:`shared`."""
    command, env = stand_in(env)
    return ["--no-python", *command, str(script), *map(str, args)], env


# --- the stand-in (torchrun's "rank") ------------------------------------------------------------------------------

def _stand_in(argv: list[str]) -> None:
    env = dict(os.environ)
    path = env.pop(SERVER_VAR)
    if argv[0] == "-m":
        req = {"script": None, "module": argv[1], "argv": argv[2:], "cwd": os.getcwd(), "env": env}
    else:
        req = {"script": argv[0], "argv": argv[1:], "cwd": os.getcwd(), "env": env}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    socket.send_fds(sock, [json.dumps(req).encode()], [0, 1, 2])
    pid = int(json.loads(sock.recv(1 << 16))["pid"])

    def forward(signum: int, _frame: Any) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    reply = sock.recv(1 << 16)  # retried after a forwarded signal (PEP 475)
    if not reply:
        print("rk_ranks: the rank server went away", file=sys.stderr)
        os._exit(1)
    code = int(json.loads(reply)["returncode"])
    if code < 0:  # die as the rank died: torchrun reads the signal from its worker's exit status
        if -code in FORWARDED:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


# --- the server ----------------------------------------------------------------------------------------------------

def _rank(req: dict[str, Any], fds: list[int]) -> None:
    """In the forked rank: the stand-in's streams as 0, 1 and 2, unbuffered as ``python -u``; then as a
    :class:`rk_forked.ForkedRuns` run."""
    import io

    from rk_forked import _child

    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True,
                                  encoding=sys.stdout.encoding, errors=sys.stdout.errors)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True,
                                  encoding=sys.stderr.encoding, errors="backslashreplace")
    _child({**req, "replace_env": True, "new_session": True, "streams_ready": True})


def _receives(conn: socket.socket) -> bool:
    """Whether ``conn`` (readable) still has its stand-in at the other end: it never writes after its request."""
    try:
        return bool(conn.recv(1))
    except OSError:
        return False


def _serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(16)
    print(json.dumps({"threads": threading.active_count()}), flush=True)
    ranks: dict[int, socket.socket] = {}  # pid -> its stand-in's connection
    conns: dict[socket.socket, int] = {}
    try:
        while True:
            readable, _, _ = select.select([sys.stdin, listener, *conns], [], [], 0.05)
            if sys.stdin in readable and not sys.stdin.readline():
                return  # the test process closed our input (or ended)
            if listener in readable:
                conn, _ = listener.accept()
                try:
                    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                except OSError:
                    data, fds = b"", []
                if not data or len(fds) != 3:  # a stand-in that died before it asked
                    for fd in fds:
                        os.close(fd)
                    conn.close()
                    continue
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    for c in [conn, *conns]:
                        c.close()
                    _rank(json.loads(data), fds)
                for fd in fds:
                    os.close(fd)
                try:
                    conn.send(json.dumps({"pid": pid}).encode())
                except OSError:  # the stand-in is gone: its connection reads as closed below, and the rank is killed
                    pass
                ranks[pid], conns[conn] = conn, pid
            for conn in readable:
                if conn in conns and not _receives(conn):  # the stand-in died: so does its rank
                    try:
                        os.kill(conns[conn], signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            while ranks:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = ranks.pop(pid)
                del conns[conn]
                try:
                    conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                except OSError:
                    pass
                conn.close()
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        import git  # noqa: F401 - gitpython, which every recording's code snapshot imports (git_info)
        import torch  # noqa: F401 - once, here: every rank forked from this process has it
        import torch.distributed  # noqa: F401

        import reprokit  # noqa: F401

        _serve(sys.argv[2])
    else:
        _stand_in(sys.argv[1:])
