"""Incidents of a multi-rank run beyond the first failure: a loop that recovers and fails again, two runs sharing one
``out_dir``, an output folder where no incident can be declared (gloo on the CPU)."""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from rk_testing import PROJECTS, torchrun

import reprokit
from reprokit.bundle import REPLICATED, open_bundle
from reprokit.cli import main as cli
from reprokit.distributed import IncidentBoard, RankInfo
from reprokit.distributed.incident import free_port
from reprokit.errors import RecorderWarning
from reprokit.report import format_incident

sys.path.insert(0, str(PROJECTS))

import rk_dist_incidents  # noqa: E402


def _torchrun(out: Path, scenario: str) -> subprocess.CompletedProcess:
    return torchrun(PROJECTS / "rk_dist_incidents.py", out, scenario, cwd=out.parent, timeout=120)


@pytest.mark.slow
def test_a_second_incident_after_recovery_gets_its_own_folder_on_every_rank(tmp_path):
    """Rank 1 feeds a NaN at step 3, every rank skips the step and goes on, rank 1 feeds another at step 9. The
    second failure is an incident of its own: every rank writes its window of step 9 into a second folder (it was
    reported as the first incident's bundle, and no window of step 9 was written), and rank 1's bundle references
    rank 0's state of that incident (replicated DDP state)."""
    out = tmp_path / "repros"
    proc = _torchrun(out, "recover-replicated")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "mark of this run" not in proc.stderr, "every rank shares out_dir"
    folders = sorted(p for p in out.iterdir() if p.name.startswith("incident-"))
    assert [int(p.name.split("-step")[1][:8]) for p in folders] == [3, 9], folders
    for folder, step in zip(folders, (3, 9)):
        by_rank = {}
        for b in folder.iterdir():
            bundle = open_bundle(b)
            assert bundle.run["distributed"]["incident"] == folder.name
            assert bundle.failure.step == step and bundle.steps[-1] == step, (b, bundle.steps)
            by_rank[bundle.run["distributed"]["rank"]] = bundle.failure.kind
        assert by_rank == {1: "nonfinite_loss", 0: "nonfinite_grad"}, (folder, by_rank)
        (rank1,) = folder.glob("*rank1of2")
        owner = json.loads((rank1 / REPLICATED).read_text())["owner"]
        assert (folder / owner["bundle"]).is_dir() and owner["step"] == step - 1, owner
    # each rank's error names the bundle of the incident it belongs to
    for rank in (0, 1):
        lines = [x for x in proc.stdout.splitlines() if x.startswith(f"rank {rank} step ")]
        assert len(lines) == 2 and f"/{folders[0].name}/" in lines[0] and f"/{folders[1].name}/" in lines[1], lines
    # the second incident's windows line up: replayed on two ranks, it fails as recorded
    r = CliRunner().invoke(cli, ["replay", str(folders[1]), "--json"])
    d = json.loads(r.stdout)
    assert r.exit_code == 1 and d["verdict"] == "deterministic" and d["incident"]["step"] == 9, r.output
    assert all(x["reproduced"] for x in d["ranks"]), d["ranks"]
    # the run's out_dir itself (what a user passes first): named as a folder of incidents, with the command
    r = CliRunner().invoke(cli, ["replay", str(out)])
    assert r.exit_code == 3 and "2 incident folder(s)" in r.output, r.output
    assert f"`reprokit replay {folders[1]}`" in r.output and folders[0].name in r.output, r.output
    # rank 1's bundle of the second incident copied over the first's: refused, naming each bundle's incident
    mixed = tmp_path / "mixed"
    shutil.copytree(folders[0], mixed)
    (rank1,) = mixed.glob("*rank1of2")
    shutil.rmtree(rank1)
    (later,) = folders[1].glob("*rank1of2")
    shutil.copytree(later, mixed / later.name)
    r = CliRunner().invoke(cli, ["replay", str(mixed)])
    assert r.exit_code == 3 and "mixes bundles of different runs or incidents" in r.output, r.output
    assert folders[0].name in r.output and folders[1].name in r.output, r.output
    # a rank missing: named, with the command that replays a rank that failed itself alone
    shutil.rmtree(mixed / later.name)
    r = CliRunner().invoke(cli, ["replay", str(mixed)])
    assert r.exit_code == 3 and "ranks [1] of 2 have no bundle" in r.output, r.output
    assert "reprokit replay " in r.output and "rank0of2" in r.output, r.output


def test_two_runs_failing_at_the_same_step_in_one_out_dir_never_share_an_incident(tmp_path):
    """Two jobs of a sweep write into one ``out_dir`` and fail at the same step in the same second: their incidents
    (folders, and what rank 1 matches rank 0's bundle by) must differ."""
    a = IncidentBoard(tmp_path, RankInfo(0, 2, 0, "gloo", "3f9c2a1b5e6d7c80"))
    b = IncidentBoard(tmp_path, RankInfo(0, 2, 0, "gloo", "0b1e44d2a9f03c17"))
    first, second = a.declare(6, 0, "non-finite loss"), b.declare(6, 0, "non-finite loss")
    assert first["incident"] != second["incident"], (first, second)
    assert a.declare(6, 1, "x")["incident"] == first["incident"], "a rank of the same run joins the same incident"


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_an_incident_that_cannot_be_declared_leaves_the_training_s_own_error(tmp_path, world_of_one):
    """``out_dir`` is a file (a read-only or full disk behaves alike): the step's own IndexError reaches the loop,
    with a warning, never an OSError of reprokit's bookkeeping."""
    out = tmp_path / "not-a-folder"
    out.write_text("")
    state = rk_dist_incidents.build({})
    rec = reprokit.Recorder(state, rk_dist_incidents.train_step, build=rk_dist_incidents.build, config={}, out_dir=out,
                            snapshot_every=2, incident_wait_s=1)
    try:
        x = torch.randn(8, 8)
        rec.step({"x": x, "y": x.sum(1), "boom": torch.tensor(False)})
        with pytest.warns(RecorderWarning, match="could not be declared"), \
                pytest.raises(IndexError, match="out of bounds") as e:
            rec.step({"x": x, "y": x.sum(1), "boom": torch.tensor(True)})
        assert "no bundle could be written" in "".join(getattr(e.value, "__notes__", []))
    finally:
        rec.close()


@pytest.fixture(scope="module")
def raise_late(tmp_path_factory) -> Path:
    """The incident of one torchrun (shared by the tests that only replay it): rank 1 raises before its backward at
    step 7 (snapshot every 4 steps: a window of steps 4..7), rank 0 waits in step 7's all-reduce."""
    out = tmp_path_factory.mktemp("raise_late") / "repros"
    proc = _torchrun(out, "raise-late")
    assert proc.returncode != 0 and "IndexError" in proc.stderr, proc.stderr[-3000:]
    (folder,) = [p for p in out.iterdir() if p.name.startswith("incident-")]
    return folder


@pytest.mark.slow
def test_a_rank_whose_process_dies_in_the_replay_is_an_error_never_fixed(raise_late, tmp_path, monkeypatch):
    """The failing rank's process dies in the failing step of the replay (a segfault, an OOM kill): it writes no
    report of its own. That is no evidence of a fix: the rank is judged as a death at that step, a different failure
    from the recorded IndexError, and the incident replay exits 125 (it once said not_reproduced, exit 0, the verdict
    of a fixed bug)."""
    folder = raise_late
    monkeypatch.setenv(rk_dist_incidents.CRASH_ENV, "1")  # the replay's ranks: the failing step kills its process
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)  # tempfile reads TMPDIR again
    r = CliRunner().invoke(cli, ["replay", str(folder), "--json"])
    d = json.loads(r.stdout)
    assert r.exit_code == 125 and d["verdict"] == "different_failure" and not d["reproduced"], r.output
    # the killed ranks' private code copies went too (torch's own inductor cache folder may stay: not ours)
    assert [p for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []
    failing = next(x for x in d["ranks"] if x["rank"] == 1)
    assert failing["failure"]["kind"] == "crash" and failing["failure"]["step"] == 7, failing
    assert failing["recorded_failure"]["exception_type"] == "IndexError", failing
    assert "rank 1" in format_incident(d) and "step 7" in format_incident(d), format_incident(d)
    if torch.cuda.device_count() < 2:  # ranks that cannot start where asked: refused before any starts (was exit 0)
        r = CliRunner().invoke(cli, ["replay", str(folder), "--device", "cuda"])
        assert r.exit_code == 2 and "use --device cpu" in r.output, r.output


@pytest.mark.slow
def test_times_replays_each_run_with_every_rank_starting_it_together(raise_late):
    """Rank 1 raises before its backward at step 7 (window 4..7): rank 0 waits in step 7's all-reduce. With
    --times 2 the second run must not pair rank 1's step-4 all-reduce with rank 0's first-run step 7 (its
    gradients then mixed two runs' and its losses from step 5 on were another training's): both runs of rank 1
    see the same losses."""
    r = CliRunner().invoke(cli, ["replay", str(raise_late), "--times", "2", "--json"])
    d = json.loads(r.stdout)
    assert r.exit_code == 1 and d["verdict"] == "deterministic", r.output
    failing = next(x for x in d["ranks"] if x["rank"] == 1)
    assert (failing["runs"], failing["failed_runs"]) == (2, 2), failing
    # two runs (one launch each) did tell deterministic from flaky: the JSON must not say it was unchecked
    assert failing["determinism_checked"] is True and d["determinism_checked"] is True, (failing, d)
    losses = [[x["loss"] for x in run["losses"]] for run in failing["per_run"]]
    assert len(losses[0]) == 4 and losses[0] == losses[1], losses
    assert failing["fidelity"]["runs_bit_identical"] is True


@pytest.mark.slow
def test_a_rank_recording_into_another_folder_than_rank_0_is_told_at_attach(tmp_path):
    """``out_dir=f"repros/rank{rank}"``: no rank would see another's incident (and a rank blocked in a collective
    would write nothing). Rank 1 says so when its Recorder attaches, before any failure."""
    out = tmp_path / "repros"
    proc = _torchrun(out, "split")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [x for x in proc.stderr.splitlines() if "mark of this run is not" in x]
    assert len(warned) == 1 and "rank 1 records into" in warned[0] and "rank1" in warned[0], proc.stderr[-3000:]


def test_run_json_and_inspect_say_which_attempt_rank_local_rank_and_backend_wrote_a_bundle(tmp_path, world_of_one,
                                                                                         monkeypatch):
    """Under ``torchrun --max-restarts``, every attempt records its own incidents: ``restart`` (the attempt),
    ``local_rank`` and ``backend`` are in run.json and ``inspect --json`` (which showed rank and world size only)."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    state = rk_dist_incidents.build({})
    rec = reprokit.Recorder(state, rk_dist_incidents.train_step, build=rk_dist_incidents.build, config={},
                            out_dir=tmp_path / "repros", snapshot_every=2, incident_wait_s=1)
    try:
        x = torch.randn(8, 8)
        rec.step({"x": x, "y": x.sum(1), "boom": torch.tensor(False)})
        with pytest.raises(IndexError):
            rec.step({"x": x, "y": x.sum(1), "boom": torch.tensor(True)})
    finally:
        rec.close()
    (bundle,) = rec.bundles
    assert open_bundle(bundle).run["distributed"]["restart"] == 1
    d = json.loads(CliRunner().invoke(cli, ["inspect", str(bundle), "--json"]).stdout)
    assert (d["rank"], d["world_size"], d["local_rank"], d["backend"], d["restart"]) == (0, 1, 0, "gloo", 1), d
    assert d["incident"] == bundle.parent.name


@pytest.mark.slow
def test_a_recorder_on_rank_0_only_neither_hangs_nor_waits_for_ranks_that_record_nothing(tmp_path):
    """Tooling on rank 0 alone: attaching took a collective rank 1 never joined (training hung for the process
    group's timeout, then died in gloo). Now rank 0 records its NaN at step 3 at once, and does not wait
    ``incident_wait_s`` (20 s here) for a rank that has no Recorder."""
    out = tmp_path / "repros"
    t0 = time.monotonic()
    proc = _torchrun(out, "rank0-only")
    seconds = time.monotonic() - t0
    assert "rank 0 step 3: TrainingFailure" in proc.stdout, proc.stderr[-3000:]
    # No wait for rank 1: the warning would say so (a wall-clock bound alone misfires on a loaded machine). No hang:
    # the old collective at attach held training for the process group's timeout (60 s).
    assert "did not write their window" not in proc.stderr, proc.stderr[-3000:]
    assert seconds < 50, (seconds, proc.stderr[-3000:])
    (folder,) = [p for p in out.iterdir() if p.name.startswith("incident-")]
    (bundle,) = folder.iterdir()
    assert open_bundle(bundle).failure.kind == "nonfinite_loss" and bundle.name.endswith("rank0of2")


@pytest.mark.slow
def test_a_script_that_ends_without_closing_its_recorder_still_writes_a_late_peers_window(tmp_path):
    """Rank 1 raises in the last step, after the all-reduce; rank 0 finishes its loop and its script ends at once,
    without ``rec.close()``. Its incident watcher had seen the incident and was in its grace second: the interpreter
    exit cut that daemon thread off, rank 0's window was lost and rank 1 waited ``incident_wait_s`` for it. Exit now
    lets the watcher finish (or writes the window from the exiting thread)."""
    out = tmp_path / "repros"
    proc = _torchrun(out, "exit-unclosed")
    assert "rank 1 step 11: IndexError" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "rank 0 exits with the incident unwritten: True" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert "did not write their window" not in proc.stderr, proc.stderr[-3000:]
    (folder,) = [p for p in out.iterdir() if p.name.startswith("incident-")]
    kinds = {open_bundle(b).run["distributed"]["rank"]: open_bundle(b).failure.kind for b in folder.iterdir()}
    assert kinds == {0: "peer", 1: "exception"}, kinds
