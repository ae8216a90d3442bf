"""The CLI, through click's CliRunner and through a real subprocess."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from rk_testing import cli_process, entries

from reprokit.cli import main


def test_replay_json_and_exit_code(nan_bundle):
    result = CliRunner().invoke(main, ["replay", str(nan_bundle), "--times", "2", "--json"])
    assert result.exit_code == 1, result.output
    d = json.loads(result.output)
    assert d["reproduced"] is True and d["runs"] == 2 and d["failed_runs"] == 2 and d["verdict"] == "deterministic"
    assert d["failure"]["kind"] == "nonfinite_loss" and d["failure"]["step"] == 6
    assert {"kind", "step", "exception_type", "message"} <= d["failure"].keys()
    assert d["fidelity"]["bit_exact"] is True and d["fidelity"]["steps_compared"] == 3


def test_replay_human_output(nan_bundle):
    result = CliRunner().invoke(main, ["replay", str(nan_bundle)])
    assert result.exit_code == 1
    assert "REPRODUCED: 1/1" in result.output and "bit-exact" in result.output


def test_inspect_json_keys(nan_bundle):
    result = CliRunner().invoke(main, ["inspect", str(nan_bundle), "--json"])
    assert result.exit_code == 0, result.output
    d = json.loads(result.output)
    assert d["failure"]["kind"] == "nonfinite_loss" and d["failure"]["step"] == 6
    assert d["window"] == {"start": 4, "end": 6, "steps": 3}
    assert d["batch"]["x"] == {"shape": [16, 8], "dtype": "float32"}
    assert d["state"]["model"] > 0 and d["state"]["optimizer"] > 0
    assert d["env"]["torch"] and len(d["losses"]) == 7 and d["losses"][-1]["loss"] == "nan"
    text = CliRunner().invoke(main, ["inspect", str(nan_bundle)]).output
    assert "nonfinite_loss at step 6" in text and "x: float32[16, 8]" in text


def test_verify_lists_every_problem(nan_bundle):
    ok = CliRunner().invoke(main, ["verify", str(nan_bundle), "--json"])
    assert ok.exit_code == 0 and json.loads(ok.output) == {"bundle": str(nan_bundle), "ok": True, "problems": []}
    (nan_bundle / "steps" / "00000004.json").write_text("{}")
    (nan_bundle / "state" / "state.safetensors").unlink()
    (nan_bundle / "notes.txt").write_text("hi")
    bad = CliRunner().invoke(main, ["verify", str(nan_bundle), "--json"])
    assert bad.exit_code == 1
    problems = {p["file"]: p for p in json.loads(bad.output)["problems"]}
    assert problems["steps/00000004.json"]["problem"] == "checksum mismatch"
    assert problems["steps/00000004.json"]["expected"] != problems["steps/00000004.json"]["found"]
    assert problems["state/state.safetensors"]["problem"] == "missing"
    assert problems["notes.txt"]["problem"] == "unexpected file"
    assert len(problems) == 3


def test_tampered_bundle_exits_3(nan_bundle):
    p = nan_bundle / "steps" / "00000006.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x01
    p.write_bytes(bytes(data))
    for cmd in ("replay", "inspect"):
        result = CliRunner().invoke(main, [cmd, str(nan_bundle)])
        assert result.exit_code == 3, (cmd, result.output)
        assert "steps/00000006.safetensors: checksum mismatch" in result.output


def test_code_that_does_not_import_exits_125(nan_bundle, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "rk_mlp.py").write_text("def build(:\n")
    result = CliRunner().invoke(main, ["replay", str(nan_bundle), "--code", str(broken), *entries(nan_bundle)])
    assert result.exit_code == 125
    assert "cannot import rk_mlp:build" in result.output and "SyntaxError" in result.output


def test_usage_errors_exit_2(nan_bundle, tmp_path):
    assert CliRunner().invoke(main, ["replay", str(tmp_path / "nope")]).exit_code == 2
    assert CliRunner().invoke(main, ["replay", str(nan_bundle), "--times", "0"]).exit_code == 2
    not_a_bundle = tmp_path / "empty"
    not_a_bundle.mkdir()
    result = CliRunner().invoke(main, ["replay", str(not_a_bundle)])
    assert result.exit_code == 3 and "is an empty folder, not a bundle" in result.output
    (not_a_bundle / "notes.txt").write_text("hello")
    result = CliRunner().invoke(main, ["replay", str(not_a_bundle)])
    assert result.exit_code == 3 and "is not a bundle folder" in result.output and "manifest.json" in result.output


@pytest.mark.slow
def test_subprocess_replay_from_unrelated_cwd(nan_bundle):
    proc = cli_process("replay", str(nan_bundle), "--json")
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "deterministic"
    proc = cli_process("verify", str(nan_bundle))
    assert proc.returncode == 0 and "ok" in proc.stdout


@pytest.mark.slow
def test_subprocess_demo(tmp_path, fork_server):
    # `python -m reprokit demo` (and the replay and the second demo) as processes of their own, forked from the fork
    # server (no torch import each); a fresh interpreter's start-up is test_subprocess_replay_from_unrelated_cwd's.
    proc = fork_server.reprokit("demo", "--out", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "non-finite loss at step 250" in proc.stdout
    assert "reproduced 3/3, deterministic, losses bit-exact" in proc.stdout
    assert "first module with a non-finite value: 0 (Linear), forward; its input was already non-finite" in proc.stdout
    assert "ok: every file matches; the tarball reproduces the failure (1/1 runs)" in proc.stdout
    assert (tmp_path / "repro.tar.gz").is_file() and (tmp_path / "repro.tar.gz.sha256").is_file()
    assert f"tar xzf {tmp_path / 'repro.tar.gz'} && python" in proc.stdout, "the next step works from any folder"
    bundles = list(tmp_path.glob("bundle-*"))
    assert len(bundles) == 1
    assert fork_server.reprokit("replay", bundles[0]).returncode == 1
    again = fork_server.reprokit("demo", "--out", tmp_path)  # refused before training, not after it
    assert again.returncode == 2 and "already holds shrunk and repro.tar.gz" in again.stderr, again.stderr
    assert "non-finite loss" not in again.stdout and len(list(tmp_path.glob("bundle-*"))) == 1


def test_help_texts():
    for cmd in ([], ["replay"], ["inspect"], ["verify"], ["demo"]):
        result = CliRunner().invoke(main, [*cmd, "--help"])
        assert result.exit_code == 0 and "Usage:" in result.output
