import reprokit


def test_public_names_are_pinned():
    assert sorted(reprokit.__all__) == sorted([
        "Bundle", "BundleError", "BundleVersionError", "CaptureError", "CodeLoadError", "ConfigError", "DetectSettings",
        "DidNotReproduce", "Failure", "PeerFailure", "Recorder", "RecorderWarning", "ReplayReport", "ReprokitError", "Session",
        "StateMismatchError", "TrainState", "TrainingFailure", "__version__", "open_bundle", "replay", "skip_list", "verify",
    ])
    for name in reprokit.__all__:
        assert hasattr(reprokit, name), name


def test_every_error_derives_from_the_root():
    for name in ("BundleError", "BundleVersionError", "CaptureError", "CodeLoadError", "ConfigError", "DidNotReproduce",
                 "PeerFailure", "StateMismatchError", "TrainingFailure"):
        assert issubclass(getattr(reprokit, name), reprokit.ReprokitError)


def test_settings_validate_their_fields():
    import pytest

    with pytest.raises(ValueError, match="spike_factor"):
        reprokit.DetectSettings(spike_factor=0.5)
    with pytest.raises(ValueError, match="scaler_patience"):
        reprokit.DetectSettings(scaler_patience=0)



def test_no_submodule_is_named_like_a_public_name():
    """Importing a submodule sets the package's attribute of its name: a module reprokit.replay would hide the
    function reprokit.replay once anything imported it (the module that replays is reprokit.replayer)."""
    import pkgutil
    import subprocess
    import sys
    from pathlib import Path

    assert not {m.name for m in pkgutil.iter_modules(reprokit.__path__)} & set(reprokit.__all__)
    code = ("import reprokit.replayer, reprokit, inspect; "
            "assert inspect.isfunction(reprokit.replay) and reprokit.replay is reprokit.replayer.replay, "
            "reprokit.replay")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
