"""verify, inspect and pack read a bundle; they never import its code. Only replay (and commands built on it) do."""

from __future__ import annotations

import pytest
import torch
from rk_testing import PROJECTS, bundle_of, entries, env_with_checkout, record


@pytest.mark.slow
def test_only_replay_imports_the_bundle_code(projects, tmp_path, monkeypatch, fork_server):
    marker = tmp_path / "imports.log"
    monkeypatch.setenv("RK_IMPORT_MARKER", str(marker))
    proj = projects("rk_marker")
    batches = [{"x": torch.randn(8, 4), "y": torch.randn(8)} for _ in range(5)]
    batches[3]["x"][0, 0] = float("nan")
    _, exc = record(proj, {}, batches, tmp_path / "out", snapshot_every=2)
    bundle = bundle_of(exc)
    assert (bundle / "code" / "rk_marker.py").is_file()
    marker.unlink()  # recording imported the live module; from here on only the bundle's copy could
    env = env_with_checkout(RK_IMPORT_MARKER=str(marker))
    for args in (["verify", str(bundle)], ["inspect", str(bundle)], ["inspect", str(bundle), "--json"],
                 ["pack", str(bundle), "-o", str(tmp_path / "r.tar.gz")], ["verify", str(tmp_path / "r.tar.gz")],
                 ["inspect", str(tmp_path / "r.tar.gz")]):
        # each command a process of its own, forked from the shared fork server (which never imported the project)
        proc = fork_server.capture(args, module="reprokit", cwd=tmp_path, env=env, replace_env=True)
        assert proc.returncode == 0, (args, proc.stdout, proc.stderr)
        assert not marker.exists(), f"reprokit {' '.join(args)} imported the bundle's code"
    proc = fork_server.capture(["replay", bundle], module="reprokit", cwd=tmp_path, env=env, replace_env=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert marker.read_text() == "imported code\n", "replay imports the code snapshot, and only that copy"


@pytest.mark.slow
def test_replay_says_it_runs_code_for_a_bundle_from_elsewhere(shared_nan_bundle, tmp_path):
    import json as _json

    from click.testing import CliRunner

    from reprokit.cli import main

    bundle = shared_nan_bundle
    runner = CliRunner()
    local = runner.invoke(main, ["replay", str(bundle)])
    assert local.exit_code == 1 and "replaying runs code" not in local.stderr, "recorded here: no note"
    packed = tmp_path / "r.tar.gz"
    assert runner.invoke(main, ["pack", str(bundle), "-o", str(packed)]).exit_code == 0
    foreign = runner.invoke(main, ["replay", str(packed), "--json"])
    assert foreign.exit_code == 1 and "replaying runs code" in foreign.stderr
    assert _json.loads(foreign.stdout)["reproduced"], "stdout is still the one JSON object"
    trusted = runner.invoke(main, ["replay", str(packed), "--trust"])
    assert trusted.exit_code == 1 and "replaying runs code" not in trusted.stderr
    # With --code, the code that runs is the user's own checkout: nothing to warn about.
    own = runner.invoke(main, ["replay", str(packed), "--code", str(PROJECTS), *entries(bundle)])
    assert own.exit_code == 1 and "replaying runs code" not in own.stderr, own.output
    env = _json.loads((bundle / "env.json").read_text())
    assert env["host"], "the recording host is in env.json"
