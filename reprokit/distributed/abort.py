"""Ending a rank's part of the run once an incident is written (``Recorder(on_incident="abort")``).

A rank whose peer failed before a collective waits in that collective until the backend's timeout (NCCL's
watchdog: 10 minutes by default, often raised to 30 or 60), and so does a failing rank whose exit path enters a
collective (``dist.barrier()``, or NCCL's ``destroy_process_group``). Once every rank's window is in the incident
folder, nothing is left to wait for: the recorder aborts the process group through PyTorch's own
``ProcessGroup.abort()``, which makes a blocked NCCL call return with an error.

Gloo has no such switch: ``ProcessGroup.abort()`` and ``shutdown()`` return at once but leave a blocked gloo call
blocked (measured on torch 2.13: an ``all_reduce`` returned only when the peer's process ended, 6 s later, with
"Connection closed by peer"). A gloo collective does break when a peer's process ends, so under gloo a rank that is
still blocked after its window (and every other live rank's) is written ends its own process (``os._exit``, a line
on stderr saying why); the peers' collectives then break, and torchrun ends the job.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ON_INCIDENT = ("abort", "wait")
"""``abort``: a rank that did not fail itself ends its part once every window is written; ``wait``: it waits in its
collective (until the backend's timeout, or until the failing rank's process ends)."""

ABORT_GRACE_S = 2.0
"""How long a rank's watcher, once every window is written, waits for its main thread to finish the step it was in
before deciding that it is blocked: a rank whose own step fails in the same incident (a NaN all-reduced into its
gradients) raises its own failure instead, and a loop that catches it may go on."""

UNBLOCK_S = 5.0
"""How long a rank still blocked in its step once every window is written waits for its collective to return
(aborted, or under gloo broken by the failing rank's process ending) before it ends its own process."""


def check_on_incident(value: Any) -> str:
    """``value`` as the ``on_incident`` option, or a ConfigError naming it."""
    if value not in ON_INCIDENT:
        from reprokit.errors import ConfigError

        raise ConfigError.option("on_incident", f"{{opt}} must be \"abort\" or \"wait\", got {value!r}: \"abort\" (the "
                                                f"default) ends every rank once an incident's windows are written; "
                                                f"\"wait\" leaves a blocked rank to the backend's timeout")
    return str(value)


def abort_interrupts(backend: str) -> bool:
    """Whether ``ProcessGroup.abort()`` can make a call blocked in this backend return: NCCL and the other device
    backends, also in a mixed ``cpu:gloo,cuda:nccl`` group (the device collectives are NCCL's); gloo alone cannot
    (see the module's docstring)."""
    parts = [x.rsplit(":", 1)[-1].strip().lower() for x in backend.split(",")]
    return any(x and x != "gloo" for x in parts)


def abort_process_group() -> str | None:
    """Abort the default process group from any thread; returns None, or why it could not be aborted.

    ``ProcessGroup.abort()`` (public on the process group object) where torch has it, else the private
    ``_abort_process_group`` of older releases. A process group aborted this way is still registered, so the user's
    ``dist.destroy_process_group()`` after it returns as usual.
    """
    import torch.distributed as dist

    try:
        group = dist.distributed_c10d._get_default_group()
        abort = getattr(group, "abort", None)
        if abort is not None:
            abort()
        else:
            dist.distributed_c10d._abort_process_group(group)
    except Exception as e:  # an abort that fails must not hide why this rank stops
        return f"{type(e).__name__}: {e}"
    return None


def end_process(message: str, code: int = 1) -> None:
    """Leave now (gloo): say why on stderr, flush, and ``os._exit`` without running ``finally`` blocks or atexit
    hooks, which would enter the same blocked collective again."""
    try:
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
    finally:
        os._exit(code)
