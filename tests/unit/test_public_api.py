import reprokit


def test_public_names_are_pinned():
    assert sorted(reprokit.__all__) == sorted([
        "Bundle", "BundleError", "BundleVersionError", "CaptureError", "CodeLoadError", "ConfigError", "DetectSettings",
        "DidNotReproduce", "Failure", "PeerFailure", "Recorder", "RecorderWarning", "ReplayReport", "ReprokitError", "Session",
        "StateMismatchError", "TrainState", "TrainingFailure", "__version__", "open_bundle", "replay", "verify",
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
