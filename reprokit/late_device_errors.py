"""Device errors that surface outside the recorder's own calls.

A step's kernels run after ``Recorder.step`` has returned (the host queues work ahead; lagged checks never make it
wait), so a device-side assert in step k reaches the host at the loop's next synchronizing call: often the next
batch's ``.to(device)``, a ``.item()`` in a logging line, or the framework's own code, none of which the recorder
wraps. Such an exception ends the loop without passing through the recorder. Three ways still reach every live
Recorder that watches a GPU, so that it writes its ``device_error`` bundle from host memory
(:meth:`reprokit.Recorder.report_device_error`):

- an exception that ends the process uncaught: a ``sys.excepthook`` in front of the one that was installed writes the
  bundle and adds a note naming it, which that hook then prints with the traceback;
- ``with Recorder(...)``: the block's exception (``Recorder.__exit__``);
- the process ending after its code caught the error: at exit, one non-blocking query of the model device's stream
  (it raises the sticky error where the device died; it never waits, so a rank stuck in a collective exits as it
  would have), for every Recorder still alive then (one held only by a function that has returned is gone).

A program that catches the error and goes on can call ``rec.report_device_error(e)`` itself.
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reprokit.record import Recorder

_LIVE: weakref.WeakSet[Recorder] = weakref.WeakSet()
_LOCK = threading.Lock()
_INSTALLED = False


def watch(rec: Recorder) -> None:
    """Reach ``rec`` on a device error that surfaces outside it (until :func:`forget`)."""
    global _INSTALLED
    with _LOCK:
        _LIVE.add(rec)
        if not _INSTALLED:
            _INSTALLED = True
            previous = sys.excepthook

            def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
                try:
                    _report_all(exc)
                finally:  # even interrupted while writing, the installed hook still reports the exception
                    previous(exc_type, exc, tb)

            sys.excepthook = hook
            atexit.register(_at_exit)


def forget(rec: Recorder) -> None:
    with _LOCK:
        _LIVE.discard(rec)


def _live() -> list[Recorder]:
    with _LOCK:
        return list(_LIVE)


def _report_all(exc: BaseException) -> None:
    for rec in _live():
        try:
            rec.report_device_error(exc)
        except Exception:  # the user's exception is what the process ends with, whatever happens here
            pass


def _at_exit() -> None:
    for rec in _live():
        try:
            rec._exit_probe()
        except Exception:
            pass
