"""Replicated DDP state, written once (gloo, 2 CPU ranks under torchrun): rank 0 snapshots the model and optimizer
state; rank 1's bundle holds its batches and RNG and references rank 0's state files by digest."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from rk_testing import PROJECTS, ddp_nan_run, torchrun

from reprokit.bundle import LOCAL_RNG, MANIFEST, REPLICATED, _self_digest, dumps, open_bundle, reference, verify
from reprokit.cli import main as cli
from reprokit.distributed import replicated
from reprokit.errors import BundleError
from reprokit.pack import pack

PROJECT = PROJECTS / "rk_ddp.py"


def _torchrun(out: Path, *args: str) -> subprocess.CompletedProcess:
    return torchrun(PROJECT, out, *args, cwd=out.parent)


def _by_rank(out: Path) -> tuple[Path, dict[int, Path]]:
    (folder,) = [p for p in out.iterdir() if p.name.startswith("incident-")]
    return folder, {open_bundle(p).run["distributed"]["rank"]: p for p in folder.iterdir() if p.name.startswith("bundle-")}


@pytest.fixture(scope="module")
def incident(tmp_path_factory):
    """rank 1 feeds a NaN at step 6 (windows start at the snapshot of step 4); replicated_state left at "auto". The
    run test_distributed.py reads too, in one test process (``rk_testing.ddp_nan_run``): read-only here as there."""
    out, proc, _ = ddp_nan_run(tmp_path_factory)
    assert proc.returncode != 0 and "TrainingFailure" in proc.stderr, proc.stderr[-3000:]
    assert "RecorderWarning" not in proc.stderr, proc.stderr[-3000:]
    return _by_rank(out)


def _copy(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest / folder.name)
    return dest / folder.name


@pytest.mark.slow
def test_rank_1_references_rank_0_s_state_and_both_replay_bit_exact(incident, tmp_path):
    folder, ranks = incident
    owner, mine = open_bundle(ranks[0]), open_bundle(ranks[1])
    files = mine.manifest["files"]
    assert REPLICATED in files and LOCAL_RNG in files
    assert not [rel for rel in files if rel.startswith("state/state") and rel.endswith(".safetensors")], sorted(files)
    ref = json.loads((ranks[1] / REPLICATED).read_text())
    assert ref["owner"] == {"rank": 0, "bundle": ranks[0].name, "step": 4} and "problem" not in ref
    assert ref["files"] == {"state/state.safetensors": owner.manifest["files"]["state/state.safetensors"]}
    # The same tensors as rank 0's state (model and optimizer are replicated), read through the reference.
    tree, tensors = mine.state()
    owner_tree, owner_tensors = owner.state()
    assert tree["state"] == owner_tree["state"] and tree["step"] == 4
    model = [k for k in owner_tensors if k.startswith("model/")]
    assert model and all(tensors[k].equal(owner_tensors[k]) for k in model)
    # Host memory: rank 1's recorder held no state; run.json says what was referenced and how much it saved.
    mem1, mem0 = (b.run["recorder"]["memory"] for b in (mine, owner))
    assert (mem1["state"], mem0["state"]) == ("referenced", "snapshotted")
    assert mem1["snapshot_bytes"] == 0 and mem0["snapshot_bytes"] > 0
    assert mem1["state_bytes_saved"] == sum(t.numel() * t.element_size() for k, t in owner_tensors.items()
                                            if not k.startswith("rng/"))
    assert mem1["peak_pinned_bytes"] + mem1["peak_pageable_bytes"] < mem0["peak_pinned_bytes"] + mem0["peak_pageable_bytes"]
    # Alone: rank 1 fed the NaN itself, so it reproduces. Step 4's loss, computed from the referenced state, is
    # bit-exact; from step 5 on rank 0's gradients are missing from the all-reduce. As an incident, every step is.
    alone = CliRunner().invoke(cli, ["replay", str(ranks[1]), "--json"])
    assert alone.exit_code == 1, alone.output
    assert json.loads(alone.stdout)["fidelity"]["first_diverging_step"] == 5, alone.stdout
    together = CliRunner().invoke(cli, ["replay", str(folder), "--json"])
    d = json.loads(together.stdout)
    assert together.exit_code == 1 and d["verdict"] == "deterministic", together.output
    assert all(x["reproduced"] and x["fidelity"]["bit_exact"] for x in d["ranks"]), d["ranks"]
    # inspect says where the state lives; verify lists the referenced file as fine.
    shown = CliRunner().invoke(cli, ["inspect", str(ranks[1])])
    assert f"referenced from rank 0's bundle {ranks[0].name} (snapshot at step 4)" in shown.stdout, shown.output
    assert json.loads(CliRunner().invoke(cli, ["inspect", str(ranks[1]), "--json"]).stdout)["state"]["model"] > 0
    assert reference.check(ranks[1], ref, hash_tensors=True) == [
        {"file": f"{ranks[0].name}/state/state.safetensors (referenced)", "status": "ok"}]
    checked = CliRunner().invoke(cli, ["verify", str(ranks[1])])
    assert checked.exit_code == 0, checked.output
    assert f"referenced {ranks[0].name}/state/state.safetensors: ok" in checked.stdout, checked.output
    # shrink's output bundle holds the state itself
    shrunk = CliRunner().invoke(cli, ["shrink", str(ranks[1]), "-o", str(tmp_path / "s1"), "--json"])
    assert shrunk.exit_code == 0, shrunk.output
    small = open_bundle(json.loads(shrunk.stdout)["output"])
    assert REPLICATED not in small.manifest["files"] and "state/state.safetensors" in small.manifest["files"]
    assert any(k.startswith("model/") for k in small.state()[1])
    d = json.loads(shrunk.stdout)
    assert d["state_referenced_before"] and d["state_bytes_after"] > d["state_bytes_before"], d
    # Larger on disk for that reason, and the text says so (not "a later state": the start is rank 0's).
    text = CliRunner().invoke(cli, ["shrink", str(ranks[1]), "-o", str(tmp_path / "s2"), "--passes", "rows"])
    assert text.exit_code == 0, text.output
    assert "larger on disk: the source's state was another rank's files" in text.output, text.output


@pytest.mark.slow
def test_a_packed_rank_1_bundle_stands_alone(incident, tmp_path):
    _, ranks = incident
    out = tmp_path / "rank1.tar.gz"
    pack(ranks[1], out)
    unpacked = tmp_path / "colleague"
    unpacked.mkdir()
    with tarfile.open(out) as tf:
        tf.extractall(unpacked, filter="data")
    (top,) = list(unpacked.iterdir())
    files = json.loads((top / "bundle" / MANIFEST).read_text())["files"]
    assert "state/state.safetensors" in files and REPLICATED not in files and LOCAL_RNG not in files
    assert CliRunner().invoke(cli, ["verify", str(out)]).exit_code == 0
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "OMP_NUM_THREADS": "1",
           "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.run([sys.executable, str(top / "repro.py"), "--json"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    d = json.loads(proc.stdout)
    assert d["verdict"] == "deterministic" and d["failure"]["kind"] == "nonfinite_loss"
    assert d["fidelity"]["first_diverging_step"] == 5, d["fidelity"]  # step 4 bit-exact from the materialised state


@pytest.mark.slow
def test_a_tampered_referenced_file_is_refused(incident, tmp_path):
    folder = _copy(incident[0], tmp_path)
    _, ranks = _by_rank(tmp_path)
    state = ranks[0] / "state" / "state.safetensors"
    data = bytearray(state.read_bytes())
    data[-1] ^= 0x01  # same size: only the digest shows it
    state.write_bytes(bytes(data))
    r = CliRunner().invoke(cli, ["verify", str(ranks[1]), "--json"])
    assert r.exit_code == 1, r.output
    assert [x["status"] for x in json.loads(r.stdout)["referenced"]] == ["mismatch"]
    assert {"file": f"{ranks[0].name}/state/state.safetensors (referenced)", "problem": "checksum mismatch"}.items() \
        <= json.loads(r.stdout)["problems"][0].items(), r.output
    replayed = CliRunner().invoke(cli, ["replay", str(ranks[1])])
    assert replayed.exit_code == 3 and "state.safetensors" in replayed.output, replayed.output
    assert CliRunner().invoke(cli, ["replay", str(folder)]).exit_code != 1


@pytest.mark.slow
def test_a_reference_out_of_the_incident_folder_is_refused(incident, tmp_path):
    _copy(incident[0], tmp_path)
    _, ranks = _by_rank(tmp_path)
    ref_path = ranks[1] / REPLICATED
    ref = json.loads(ref_path.read_text())
    ref["owner"]["bundle"] = "../../elsewhere"
    ref_path.write_bytes(dumps(ref))
    manifest = json.loads((ranks[1] / MANIFEST).read_text())  # a crafted bundle: its manifest agrees
    manifest["files"][REPLICATED] = {"sha256": replicated_sha(ref_path), "size": ref_path.stat().st_size}
    manifest["self_sha256"] = _self_digest(manifest)
    (ranks[1] / MANIFEST).write_bytes(dumps(manifest))
    problems = verify(ranks[1])
    assert any(p["file"] == REPLICATED and "plain folder name" in p["problem"] for p in problems), problems
    assert CliRunner().invoke(cli, ["replay", str(ranks[1])]).exit_code == 3


@pytest.mark.slow
def test_a_reference_that_lists_no_state_file_is_refused_before_any_tensor_is_used(incident, tmp_path):
    """A crafted reference (re-signed manifest) naming the owner but no state file: never a half-restored state."""
    _copy(incident[0], tmp_path)
    _, ranks = _by_rank(tmp_path)
    ref_path = ranks[1] / REPLICATED
    ref = json.loads(ref_path.read_text())
    ref["files"] = {}
    ref_path.write_bytes(dumps(ref))
    manifest = json.loads((ranks[1] / MANIFEST).read_text())
    manifest["files"][REPLICATED] = {"sha256": replicated_sha(ref_path), "size": ref_path.stat().st_size}
    manifest["self_sha256"] = _self_digest(manifest)
    (ranks[1] / MANIFEST).write_bytes(dumps(manifest))
    with pytest.raises(BundleError, match="complete set of state files"):
        open_bundle(ranks[1]).state()
    r = CliRunner().invoke(cli, ["replay", str(ranks[1])])
    assert r.exit_code == 3 and "complete set of state files" in r.output, r.output


def replicated_sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.slow
def test_without_the_owner_bundle_replay_says_so_and_exits_3(incident, tmp_path):
    _, ranks = incident
    alone = tmp_path / ranks[1].name
    shutil.copytree(ranks[1], alone)  # rank 1's bundle copied away from its incident folder
    r = CliRunner().invoke(cli, ["replay", str(alone)])
    assert r.exit_code == 3, r.output
    assert "(referenced): missing: this bundle's model and optimizer state is in rank 0's bundle" in r.output, r.output
    assert "reprokit pack" in r.output
    checked = CliRunner().invoke(cli, ["verify", str(alone), "--json"])
    assert checked.exit_code == 1 and [x["status"] for x in json.loads(checked.stdout)["referenced"]] == ["missing"]


def test_an_owner_that_never_writes_its_bundle_is_reported_not_waited_for_forever(tmp_path):
    t0 = time.monotonic()
    ref, tree = replicated.find_owner(tmp_path, world_size=2, incident="incident-x", step=4, timeout_s=0.3)
    assert time.monotonic() - t0 < 5 and tree == {}
    assert ref["owner"]["bundle"] is None and "had not written one" in ref["problem"], ref
    with pytest.raises(BundleError, match="cannot replay alone"):
        reference._owner_dir(tmp_path / "bundle-x", ref)


@pytest.mark.slow
def test_an_owner_window_that_starts_elsewhere_is_never_referenced(incident):
    folder, _ = incident
    ref, _ = replicated.find_owner(folder, world_size=2, incident=folder.name, step=3, timeout_s=5)
    assert ref["files"] == {} and "starts at step 4" in ref["problem"], ref


@pytest.mark.slow
def test_a_non_owner_over_its_budget_falls_back_to_a_self_contained_bundle(tmp_path):
    """Rank 1's budget holds about two steps (each holds ~41 KB of RNG state), fewer than snapshot_every=4: rather
    than restart its window on its own (it would no longer start at rank 0's snapshot), it takes its own snapshots."""
    out = tmp_path / "repros"
    proc = _torchrun(out, "nan", "cpu", "auto", f"1:{100 << 10}")
    assert proc.returncode != 0 and "TrainingFailure" in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("takes its own state snapshots from now on") == 1, proc.stderr[-3000:]
    _, ranks = _by_rank(out)
    mine = open_bundle(ranks[1])
    assert REPLICATED not in mine.manifest["files"] and "state/state.safetensors" in mine.manifest["files"]
    mem = mine.run["recorder"]["memory"]
    assert mem["state"] == "snapshotted" and mem["early_snapshots"] >= 1 and mem["snapshot_bytes"] > 0, mem
    assert mine.run["window"]["start"] != 4  # its own early snapshot, not rank 0's
    r = CliRunner().invoke(cli, ["replay", str(ranks[1])])
    assert r.exit_code == 1, r.output


@pytest.mark.slow
def test_when_the_owner_snapshots_early_the_other_ranks_take_their_own(tmp_path):
    """Rank 0's budget forces early snapshots (at step 2): rank 1, at its next snapshot step (4), sees it and takes
    its own snapshot; its window (4..6) then stands alone instead of referencing a snapshot rank 0 never took."""
    out = tmp_path / "repros"
    proc = _torchrun(out, "nan", "cpu", "auto", f"0:{100 << 10}")
    assert proc.returncode != 0 and "TrainingFailure" in proc.stderr, proc.stderr[-3000:]
    assert "rank 1: rank 0 takes early snapshots" in proc.stderr, proc.stderr[-3000:]
    _, ranks = _by_rank(out)
    owner, mine = open_bundle(ranks[0]), open_bundle(ranks[1])
    assert owner.run["recorder"]["memory"]["early_snapshots"] >= 1 and owner.run["window"]["start"] != 4
    assert REPLICATED not in mine.manifest["files"] and mine.run["window"]["start"] == 4
    assert mine.run["recorder"]["memory"]["state"] == "snapshotted"
    assert CliRunner().invoke(cli, ["replay", str(ranks[1])]).exit_code == 1


def test_replicated_state_true_without_a_process_group_is_refused_at_attach(tmp_path, monkeypatch):
    import reprokit
    from reprokit.errors import ConfigError

    monkeypatch.syspath_prepend(str(PROJECTS))
    import rk_ddp

    state = rk_ddp.build({})
    with pytest.raises(ConfigError, match="replicated_state=True needs an initialised process group"):
        reprokit.Recorder(state, rk_ddp.train_step, build=rk_ddp.build, config={}, out_dir=tmp_path,
                          replicated_state=True)
    with pytest.raises(ConfigError, match="must be \"auto\", True or False"):
        reprokit.Recorder(state, rk_ddp.train_step, build=rk_ddp.build, config={}, out_dir=tmp_path,
                          replicated_state="yes")
    rec = reprokit.Recorder(state, rk_ddp.train_step, build=rk_ddp.build, config={}, out_dir=tmp_path)
    assert rec.stats()["state"] == "snapshotted" and rec.stats()["state_bytes_saved"] == 0  # one process: auto is off
    rec.close()


@pytest.mark.slow
def test_an_owner_without_a_bundle_leaves_a_bundle_that_says_it_cannot_replay(tmp_path):
    """Rank 0's budget (1 KB) holds no step, so it records nothing and writes no bundle: rank 1 stops waiting when rank
    0 marks the incident done, and writes its batches with a reference that says why there is no state, loudly."""
    out = tmp_path / "repros"
    t0 = time.monotonic()
    proc = _torchrun(out, "nan", "cpu", "auto", "0:1024")
    assert proc.returncode != 0 and time.monotonic() - t0 < 60, proc.stderr[-3000:]  # no hang
    # "without writing one": rank 1 stopped at rank 0's done mark, not after the 30 s incident wait ("had not written
    # one after 30 s"); the message says so where a wall-clock bound would misfire on a loaded machine.
    assert "cannot replay alone" in proc.stderr and "without writing one" in proc.stderr, proc.stderr[-3000:]
    (folder,) = [p for p in out.iterdir() if p.name.startswith("incident-")]
    (mine,) = [p for p in folder.iterdir() if p.name.startswith("bundle-")]
    ref = json.loads((mine / REPLICATED).read_text())
    assert ref["owner"]["bundle"] is None and ref["files"] == {} and "rank 0" in ref["problem"], ref
    assert [p["file"] for p in verify(mine)] == [REPLICATED]
    r = CliRunner().invoke(cli, ["replay", str(mine)])
    assert r.exit_code == 3, r.output
    assert "no referenced state, so this bundle cannot replay: rank 0, which holds the state" in r.output, r.output
