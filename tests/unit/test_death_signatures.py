"""When a death is "the same failure": by signal, by exception class, and what a child's end makes of it."""

from __future__ import annotations

import signal

from reprokit.isolation import death_failure, fault_frame
from reprokit.signature import Failure, summary_line


def test_crashes_are_the_same_by_signal():
    segv = Failure("crash", 37, exc_type="SIGSEGV")
    assert segv.same_as(Failure("crash", 37, exc_type="SIGSEGV"), step=True)
    assert not segv.same_as(Failure("crash", 37, exc_type="SIGABRT"))
    assert not segv.same_as(Failure("crash", 36, exc_type="SIGSEGV"), step=True)


def test_a_crash_with_no_signal_recorded_is_the_same_as_any_signal():
    unknown = Failure("crash", 37, exc_type=None)
    assert Failure("crash", 37, exc_type="SIGKILL").same_as(unknown, step=True)
    assert unknown.same_as(Failure("crash", 37, exc_type="SIGSEGV"))
    assert not unknown.same_as(Failure("crash", 37, exc_type="SystemExit"))  # a Python-level death is no signal


def test_a_python_level_death_is_the_same_as_its_exception_class():
    died = Failure("crash", 5, exc_type="RuntimeError")
    raised = Failure("exception", 5, exc_type="RuntimeError", frame="train.py:train_step")
    assert died.same_as(raised, step=True) and raised.same_as(died)
    assert not died.same_as(Failure("exception", 5, exc_type="IndexError"))
    assert Failure("device_error", 5, exc_type="AcceleratorError").same_as(
        Failure("exception", 5, exc_type="AcceleratorError"))
    assert not Failure("exception", 5, exc_type="SIGSEGV").same_as(Failure("crash", 5, exc_type="SIGSEGV"))


def test_a_death_is_never_the_same_as_a_detector_failure():
    assert not Failure("crash", 5).same_as(Failure("nonfinite_loss", 5))


def test_death_failure_from_a_signal_an_exception_and_an_exit_status():
    f = death_failure(-signal.SIGSEGV, None, [4, 5, 6], {4: 1.0, 5: 0.5}, "tail", 123)
    assert (f.kind, f.step, f.exc_type) == ("crash", 6, "SIGSEGV")
    assert f.detail["last_finished"] == 5 and f.detail["signal"] == "SIGSEGV" and f.detail["pid"] == 123
    assert summary_line(f.summary()) == "the process died with SIGSEGV at step 6"
    py = death_failure(70, {"exc_type": "SystemExit", "message": "bye"}, [4], {}, "", 1)
    assert (py.exc_type, py.message, py.detail["signal"]) == ("SystemExit", "bye", None)
    early = death_failure(3, None, [], {}, "", 1)
    assert early.step == -1 and early.exc_type is None and "before its first step" in early.message


def test_fault_frame_names_the_innermost_user_frame():
    out = ('Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n'
           f'  File "{signal.__file__}", line 519 in string_at\n'
           '  File "/home/u/proj/train.py", line 31 in crash_here\n'
           '  File "/home/u/proj/train.py", line 45 in train_step\n')
    assert fault_frame(out) == "train.py:31 in crash_here"
    assert fault_frame("nothing useful") is None
