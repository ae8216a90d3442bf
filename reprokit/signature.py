"""What failed, and whether two failures are "the same".

Decided in one place: two failures are the same when their ``kind``, exception
type and raising frame in user code (``file:function``; where both failures
know it, ``file:Class.function`` too: two classes' ``forward`` in one file are two
places) agree. Digits are
normalised out of messages so that shape numbers may change while shrinking;
replay keeps the message for people but does not compare it (the same bug's wording
may differ between devices and torch versions), while the shrinker also requires an
exception's :func:`message_template` to stay the same. A replay *reproduces* a bundle
only when it also fails at the same step (``Failure.same_as(other, step=True)``);
the same signature at another step is a different failure.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sysconfig
import traceback
from dataclasses import asdict, dataclass, field
from enum import Enum
from types import TracebackType
from typing import Any


class FailureKind(str, Enum):
    """What failed: the ``kind`` of ``failure.json``, every kind listed once, here.

    A ``str``: a member equals its value (``FailureKind.EXCEPTION == "exception"``), prints as it and is written to
    JSON as it, so kinds read back from a bundle (plain strings) compare with members as they are.
    """

    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad"
    NONFINITE_PARAM = "nonfinite_param"
    SCALER_COLLAPSE = "scaler_collapse"
    EXCEPTION = "exception"
    LOSS_SPIKE = "loss_spike"
    PREDICATE = "predicate"
    PEER = "peer"
    """This rank did not fail; another rank of the same run did, and this is this rank's window (see
    :mod:`reprokit.distributed`)."""
    CRASH = "crash"
    """The process died during the step, without a Python frame to catch it (a signal, the OOM killer,
    ``os._exit``); written by ``reprokit recover`` from a flight log (:mod:`reprokit.recover`), or seen by an isolated
    replay. ``exc_type`` names the signal, such as ``"SIGSEGV"``, when it is known, else None; a class name for a
    death by an uncaught exception."""
    DEVICE_ERROR = "device_error"
    """The step hit a sticky device error (a CUDA device-side assert): ``exc_type`` is the exception's class."""

    def __str__(self) -> str:
        return self.value


KINDS = tuple(kind.value for kind in FailureKind)
"""Every kind's value, in :class:`FailureKind`'s order (what ``failure.json`` may hold)."""
NONFINITE = frozenset({FailureKind.NONFINITE_LOSS, FailureKind.NONFINITE_GRAD, FailureKind.NONFINITE_PARAM})
"""The kinds a non-finite value fires: they have an origin (where the first non-finite value appeared)."""
DEATHS = frozenset({FailureKind.CRASH, FailureKind.DEVICE_ERROR})
"""Failure kinds whose step can kill the process: replay and shrink run them in a child process
(:mod:`reprokit.isolation`)."""
_WHAT: dict[str, str] = {
    FailureKind.NONFINITE_LOSS: "non-finite loss",
    FailureKind.NONFINITE_GRAD: "non-finite gradient norm",
    FailureKind.NONFINITE_PARAM: "non-finite parameter",
    FailureKind.SCALER_COLLAPSE: "GradScaler skipped too many steps in a row",
    FailureKind.LOSS_SPIKE: "loss spike",
    FailureKind.PREDICATE: "user predicate fired",
    FailureKind.PEER: "another rank failed",
    FailureKind.CRASH: "the process died",
}


def _torch_dir() -> str:
    """torch's folder, found without importing torch (``inspect`` reads failures and never needs it)."""
    spec = importlib.util.find_spec("torch")
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else sysconfig.get_paths()["purelib"]


_LIBRARY_ROOTS = tuple(
    os.path.realpath(p) + os.sep
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
              _torch_dir(), os.path.dirname(__file__)}
)


@dataclass
class Failure:
    """One failure: detector kind, step, and for exceptions what raised where."""

    kind: str
    """A :class:`FailureKind` (kept as the plain string: one read from a bundle is one)."""
    step: int
    exc_type: str | None = None
    message: str = ""
    frame: str | None = None
    traceback: str = ""
    detail: dict[str, Any] = field(default_factory=dict)
    frame_qualname: str | None = None
    """``file:Class.function`` of the raising frame (Python 3.11+: ``co_qualname``); None where unknown."""

    def __post_init__(self) -> None:
        self.kind = str(self.kind)  # a FailureKind member as its value: the same object, made or read back

    def signature(self) -> dict[str, Any]:
        """The fields that decide "same failure" (plus the normalised message, for show)."""
        sig = {"kind": self.kind, "exc_type": self.exc_type, "frame": self.frame, "message": normalise(self.message)}
        if self.frame_qualname is not None:
            sig["frame_qualname"] = self.frame_qualname
        return sig

    def same_as(self, other: Failure | dict[str, Any] | None, *, step: bool = False) -> bool:
        """Same signature as ``other`` (a Failure or a ``failure.json`` dict); with ``step=True`` also the same step.

        Example:
            >>> a, b = Failure("nonfinite_loss", 34), Failure("nonfinite_loss", 37)
            >>> a.same_as(b), a.same_as(b, step=True)
            (True, False)
        """
        if other is None:
            return False
        other_sig = other.signature() if isinstance(other, Failure) else other.get("signature", other)
        other_step = other.step if isinstance(other, Failure) else other.get("step")
        return same_failure(self.signature(), other_sig) and (not step or self.step == other_step)

    def describe(self) -> str:
        what = _WHAT.get(self.kind)
        if self.kind == FailureKind.DEVICE_ERROR:
            return f"device error {self.exc_type} at step {self.step}: {self.message}"
        if self.kind == FailureKind.CRASH:
            return f"{death_words(self.exc_type)} at step {self.step}" + (f" ({self.message})" if self.message else "")
        if self.kind == FailureKind.EXCEPTION:
            where = f" in {self.frame}" if self.frame else ""
            return f"{self.exc_type}{where} at step {self.step}: {self.message}"
        extra = f" ({self.message})" if self.message else ""
        return f"{what} at step {self.step}{extra}"

    def to_json(self) -> dict[str, Any]:
        """The bundle's ``failure.json`` (format field names: ``exc_type``)."""
        return {**asdict(self), "signature": self.signature()}

    def summary(self) -> dict[str, Any]:
        """The failure as every command's ``--json`` reports it (one shape, ``exception_type`` spelled out).

        Example:
            >>> Failure("exception", 7, exc_type="IndexError", message="index 9").summary()["exception_type"]
            'IndexError'
        """
        return {"kind": self.kind, "step": self.step, "exception_type": self.exc_type, "message": self.message,
                "frame": self.frame}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Failure:
        names = {"kind", "step", "exc_type", "message", "frame", "traceback", "detail", "frame_qualname"}
        return cls(**{k: v for k, v in d.items() if k in names})


def summary_line(d: dict[str, Any] | None, *, frame: bool = True, step: bool = True) -> str:
    """One line for a :meth:`Failure.summary` dict: ``IndexError: msg at step 7 in f``, or ``kind (msg) at step 7``.

    Example:
        >>> summary_line(Failure("nonfinite_loss", 6, message="loss = nan").summary())
        'nonfinite_loss (loss = nan) at step 6'
    """
    if not d:
        return "none"
    if d.get("kind") == "crash":
        return death_words(d.get("exception_type")) + (f" at step {d['step']}" if step else "")
    what = f"{d['exception_type']}: {d['message']}" if d.get("exception_type") else f"{d['kind']} ({d['message']})"
    return what + (f" at step {d['step']}" if step else "") + (f" in {d['frame']}" if frame and d.get("frame") else "")


def normalise(message: str) -> str:
    return re.sub(r"\d+", "N", message or "").strip()


def message_template(message: str) -> str:
    """``message`` with what varies between raises of one bug masked: addresses (``0x...``) and numbers.

    The shrinker compares it (an exception of the same type in the same frame but with another message, such as a
    check that the cut batch is too small, is another bug); replay verdicts do not, since the same bug's wording
    may differ between devices and torch versions.

    Example:
        >>> message_template("index 37 is out of bounds for size 32 (tensor at 0x7f3a9c)")
        'index N is out of bounds for size N (tensor at <address>)'
    """
    return normalise(re.sub(r"0x[0-9a-fA-F]+", "<address>", message or ""))


def is_signal(name: str | None) -> bool:
    """Is ``name`` a signal's name (``"SIGSEGV"``), as a crash's ``exc_type`` holds it, not an exception class's?"""
    return name is not None and name.startswith("SIG") and name.isupper()


def death_words(exc_type: str | None) -> str:
    """How a process died, in words: ``the process died with SIGSEGV``, ``... of RuntimeError``, or with nothing
    recorded (a SIGKILL leaves no trace in the process itself)."""
    if exc_type is None:
        return "the process died (no error recorded)"
    return f"the process died {'with' if is_signal(exc_type) else 'of'} {exc_type}"


def _same_death(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The rule for signatures of which at least one is a death (:data:`DEATHS`).

    Two crashes are the same when their signals are; a crash whose signal is unknown (a SIGKILL leaves no trace, so
    a recovered bundle says None) is the same as a death by any signal. A death by an uncaught exception, or a device
    error, is the same as an exception (caught by replay, in a child process) of the same class. Frames are not
    compared: a process killed by a signal has none in user code.
    """
    ta, tb = a.get("exc_type"), b.get("exc_type")
    kinds = {a.get("kind"), b.get("kind")}
    if kinds == {"crash"}:
        return ta == tb or (ta is None and is_signal(tb)) or (tb is None and is_signal(ta))
    if kinds <= {"crash", "device_error", "exception"}:
        return ta is not None and ta == tb and not is_signal(ta)
    return False


def same_failure(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """True when two signatures describe the same failure."""
    if a is None or b is None:
        return False
    if a.get("kind") in DEATHS or b.get("kind") in DEATHS:
        return _same_death(a, b)
    if a.get("frame_qualname") and b.get("frame_qualname") and a["frame_qualname"] != b["frame_qualname"]:
        return False  # bundles from before it was recorded, or Python 3.10, compare the function's name alone
    return all(a.get(k) == b.get(k) for k in ("kind", "exc_type", "frame"))


def from_exception(exc: BaseException, step: int) -> Failure:
    """The failure of a step that raised ``exc``: an ``exception``, or a ``device_error`` for a sticky device error
    (see :func:`reprokit.device_error.is_sticky`: the process's CUDA context is gone)."""
    from reprokit.device_error import is_sticky

    return Failure(
        kind=FailureKind.DEVICE_ERROR if is_sticky(exc) else FailureKind.EXCEPTION,
        step=step,
        exc_type=type(exc).__qualname__,
        message=str(exc).splitlines()[0][:500] if str(exc) else "",
        frame=user_frame(exc.__traceback__),
        frame_qualname=user_frame(exc.__traceback__, qualname=True),
        traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-20000:],
    )


def in_library(path: str) -> bool:
    """Is ``path`` in the standard library, an installed package, torch or reprokit (not the user's code)?"""
    return os.path.realpath(path).startswith(_LIBRARY_ROOTS)


def user_frame(tb: TracebackType | None, qualname: bool = False) -> str | None:
    """``file:function`` of the deepest frame outside python, torch and reprokit (``file:Class.function`` with
    ``qualname``, on Python 3.11+; None before).

    The file is its base name so that a bundle's code snapshot, a live checkout
    and an extracted tarball all give the same signature.
    """
    found = None
    for frame, _ in traceback.walk_tb(tb):
        path = os.path.realpath(frame.f_code.co_filename)
        if path.startswith(_LIBRARY_ROOTS) or frame.f_code.co_filename.startswith("<"):
            continue
        name = getattr(frame.f_code, "co_qualname", None) if qualname else frame.f_code.co_name
        found = None if name is None else f"{os.path.basename(path)}:{name}"
    return found
