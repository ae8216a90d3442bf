"""reprokit: turn a training run that dies at step 31,204 into a small, portable repro.

Public API (everything else is internal and may change)::

    rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir="repros")
    loss = rec.step(batch)
    report = reprokit.replay("repros/bundle-...", times=3)
"""

from reprokit import inject  # noqa: F401 - a public submodule (reprokit.inject); vendored with the runtime
from reprokit._version import __version__
from reprokit.bundle import Bundle, open_bundle, verify
from reprokit.detect import DetectSettings
from reprokit.errors import (
    BundleError,
    BundleVersionError,
    CaptureError,
    CodeLoadError,
    DidNotReproduce,
    RecorderWarning,
    ReprokitError,
    StateMismatchError,
    TrainingFailure,
)
from reprokit.record import Recorder
from reprokit.replay import ReplayReport, Session, replay
from reprokit.signature import Failure
from reprokit.state import TrainState

__all__ = [
    "Bundle",
    "BundleError",
    "BundleVersionError",
    "CaptureError",
    "CodeLoadError",
    "DetectSettings",
    "DidNotReproduce",
    "Failure",
    "Recorder",
    "RecorderWarning",
    "ReplayReport",
    "ReprokitError",
    "Session",
    "StateMismatchError",
    "TrainState",
    "TrainingFailure",
    "__version__",
    "open_bundle",
    "replay",
    "verify",
]
