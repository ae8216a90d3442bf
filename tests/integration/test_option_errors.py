"""A bad option is a ConfigError (exit 2) that names the option as the caller spelled it: the Python parameter to
Python callers (``times must be >= 1``), the flag on the command line (``--times must be >= 1``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import reprokit
from reprokit.archive import bundle_dir
from reprokit.cli import main
from reprokit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DEMO = ROOT / "tests" / "golden" / "v1" / "demo-nan"


def _error(*args: str) -> dict:
    r = CliRunner().invoke(main, [*args, "--json"])
    assert r.exit_code == 2, r.output
    return json.loads(r.stdout)["error"]


def test_python_callers_read_the_parameter_name_not_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"^times must be >= 1, got 0$"):
        reprokit.replay(tmp_path / "no-bundle", times=0)
    from reprokit.shrink import shrink

    with pytest.raises(ConfigError, match=r"^budget must be >= 1, got 0$"):
        shrink(tmp_path / "no-bundle", tmp_path / "out", budget=0)
    with pytest.raises(ConfigError, match=r"^unknown shrink pass\(es\) nope in passes; choose from "):
        shrink(tmp_path / "no-bundle", tmp_path / "out", passes=["nope"])
    with pytest.raises(ConfigError, match=r"^sha256 checks an archive"), bundle_dir(GOLDEN_DEMO, sha256="0" * 64):
        pass


def test_the_cli_names_the_flag():
    e = _error("verify", str(GOLDEN_DEMO), "--sha256", "0" * 64)
    assert e["type"] == "ConfigError" and e["message"].startswith("--sha256 checks an archive")
    e = _error("shrink", str(GOLDEN_DEMO), "-o", "unused", "--passes", "nope")
    assert e["type"] == "ConfigError" and "nope in --passes" in e["message"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_a_gpu_is_an_option_error():
    from reprokit.bundle import open_bundle

    with pytest.raises(ConfigError, match=r"^device cuda was asked for, .* use device cpu$"):
        reprokit.Session(open_bundle(GOLDEN_DEMO), device="cuda")
    e = _error("replay", str(GOLDEN_DEMO), "--device", "cuda")
    assert e["message"] == "--device cuda was asked for, but torch sees no CUDA device here; use --device cpu"


def test_recorder_options_are_config_errors_and_value_errors(tmp_path, projects):
    mlp = projects("rk_mlp")
    for kw, name in (({"snapshot_every": 0}, "snapshot_every"), ({"host_memory_budget": 0}, "host_memory_budget"),
                     ({"replicated_state": "yes"}, "replicated_state")):
        state = mlp.build({})
        with pytest.raises(ConfigError, match=f"^{name} ") as e:
            reprokit.Recorder(state, mlp.train_step, build=mlp.build, config={}, out_dir=tmp_path, **kw)
        assert isinstance(e.value, ValueError) and "--" not in str(e.value)
