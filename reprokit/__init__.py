"""reprokit: turn a training run that dies at step 31,204 into a small, portable repro.

Public API (everything else is internal and may change)::

    rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir="repros")
    loss = rec.step(batch)
    report = reprokit.replay("repros/bundle-...", times=3)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from reprokit._version import __version__
from reprokit.errors import (
    BundleError,
    BundleVersionError,
    CaptureError,
    CodeLoadError,
    ConfigError,
    DidNotReproduce,
    PeerFailure,
    RecorderWarning,
    ReprokitError,
    StateMismatchError,
    TrainingFailure,
)

# The names below import torch, so they are loaded on first use (PEP 562): `import reprokit` and
# `reprokit --help` stay fast. The TYPE_CHECKING block names them for type checkers and for
# reprokit.pack.runtime_files, which vendors every module listed there.
if TYPE_CHECKING:
    from reprokit import inject  # noqa: F401 - a public submodule, imported on use; vendored with the runtime
    from reprokit.bundle import Bundle, open_bundle, verify
    from reprokit.detect import DetectSettings
    from reprokit.record import Recorder
    from reprokit.replayer import ReplayReport, Session, replay
    from reprokit.signature import Failure
    from reprokit.skip_journal import skip_list
    from reprokit.state import TrainState

_LAZY = {
    "Bundle": "reprokit.bundle", "open_bundle": "reprokit.bundle", "verify": "reprokit.bundle",
    "DetectSettings": "reprokit.detect", "Recorder": "reprokit.record", "ReplayReport": "reprokit.replayer",
    "Session": "reprokit.replayer", "replay": "reprokit.replayer", "Failure": "reprokit.signature",
    "TrainState": "reprokit.state", "skip_list": "reprokit.skip_journal",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'reprokit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Bundle",
    "BundleError",
    "BundleVersionError",
    "CaptureError",
    "CodeLoadError",
    "ConfigError",
    "DetectSettings",
    "DidNotReproduce",
    "Failure",
    "PeerFailure",
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
    "skip_list",
    "verify",
]
