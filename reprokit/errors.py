"""Every error reprokit raises on purpose derives from :class:`ReprokitError`.

Messages follow one rule: say what happened, what was expected, and what to
do next. The CLI maps each class to an exit code (see ``EXIT_CODE``).
"""

from __future__ import annotations

from typing import Any


class ReprokitError(Exception):
    """Root of every error reprokit raises on purpose."""

    exit_code = 2


DAMAGED_BUNDLE_ADVICE = ("Get an intact copy from whoever sent it, or re-record it; `reprokit verify` lists every "
                         "problem.")
"""What to do about a bundle that is damaged or not what its writer wrote: the last sentence of every such
:class:`BundleError` message (the reader's and the schema's)."""


class BundleError(ReprokitError):
    """A bundle is missing, malformed, or fails its checksums."""

    exit_code = 3

    def __init__(self, message: str, problems: list[dict[str, Any]] | None = None):
        super().__init__(message)
        self.problems = problems or []


class BundleVersionError(BundleError):
    """A bundle was written by a newer (or unknown) format version."""


class ConfigError(ReprokitError, ValueError):
    """An option has a value reprokit cannot use (also a ``ValueError``, which is what it is).

    Made by :meth:`option`, it names the option the way the caller spelled it: ``str(e)`` names the Python parameter
    (``times must be >= 1``), :attr:`cli_message` the command-line flag (``--times must be >= 1``).
    """

    def __init__(self, message: str, *, cli_message: str | None = None):
        super().__init__(message)
        self.cli_message = cli_message or message
        """The message as the CLI prints it (the flag in place of the Python parameter)."""

    @classmethod
    def option(cls, name: str, template: str) -> ConfigError:
        """An error about the option ``name``; every ``{opt}`` in ``template`` becomes ``name`` in the Python
        message and ``--name`` (underscores as dashes) in the CLI's.

        Example:
            >>> e = ConfigError.option("times", "{opt} must be >= 1, got 0")
            >>> str(e), e.cli_message
            ('times must be >= 1, got 0', '--times must be >= 1, got 0')
        """
        flag = "--" + name.replace("_", "-")
        return cls(template.replace("{opt}", name), cli_message=template.replace("{opt}", flag))


class CaptureError(ReprokitError):
    """Some piece of training state cannot be captured into a bundle."""


class CodeLoadError(ReprokitError):
    """``build`` or the step function cannot be imported for replay."""

    # 125 is what ``git bisect run`` reads as "cannot test this commit, skip it".
    exit_code = 125


class StateMismatchError(ReprokitError):
    """The recorded state does not fit the model/optimizer that ``build`` made."""

    exit_code = 125


class DoesNotFitError(StateMismatchError):
    """A file of the bundle needs more memory than this machine has available to read it (exit 125, as a state
    that does not fit: not a fault of the bundle that can be told before reading it)."""


class DidNotReproduce(ReprokitError):
    """A command needed a failing bundle, but replay did not fail the same way."""

    exit_code = 1


class TrainingFailure(ReprokitError, RuntimeError):
    """Raised into the training loop when a detector (not an exception) fires.

    Attributes:
        failure: the :class:`reprokit.signature.Failure` that fired; ``failure.step`` is the step whose values
            fired.
        bundle: path of the bundle written, or ``None`` when writing it failed
            (a warning then says why).
        detected_lag: how many steps ran after that step before its check was judged (checks lag the step so that
            the host never waits for the device; see the Recorder's ``max_lag``); 0 when seen at its own end.
    """

    def __init__(self, failure: Any, bundle: Any, lag: int = 0):
        where = f"bundle written to {bundle}" if bundle else "no bundle could be written (see the warning above)"
        seen = f" (seen {lag} step{'s' if lag != 1 else ''} later, after step {failure.step + lag}; the window ends " \
               f"at step {failure.step})" if lag else ""
        super().__init__(f"{failure.describe()}{seen}; {where}")
        self.failure = failure
        self.bundle = bundle
        self.detected_lag = lag


class PeerFailure(ReprokitError, RuntimeError):
    """Raised into this rank's training loop when another rank failed and reprokit ended this rank's part of the run
    (``Recorder(on_incident="abort")``, the default under torch.distributed): every rank's window is in the incident
    folder, and the collective this rank was blocked in (or its next step) could never complete.

    Attributes:
        incident: the incident folder (every rank's bundle), or ``None`` when it could not be declared.
        failed_rank: the rank whose failure declared the incident.
        step: the step it failed at.
    """

    def __init__(self, message: str, *, incident: Any = None, failed_rank: int | None = None,
                 step: int | None = None):
        super().__init__(message)
        self.incident = incident
        self.failed_rank = failed_rank
        self.step = step


class RecorderWarning(UserWarning):
    """The recorder hit a fault of its own; training goes on without it."""
