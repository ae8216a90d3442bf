"""Multi-rank recording under torchrun (gloo, 2 CPU processes): one incident folder, every rank's window."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rk_testing import PROJECTS, ddp_nan_run, entries, torchrun

from reprokit.bundle import open_bundle
from reprokit.cli import main as cli

PROJECT = PROJECTS / "rk_ddp.py"


def _torchrun(out: Path, mode: str, device: str = "cpu") -> tuple[subprocess.CompletedProcess, float]:
    """rk_ddp.py on two ranks; with the seconds it took (a rank stuck in a collective must not hang the run)."""
    t0 = time.monotonic()
    proc = torchrun(PROJECT, out, mode, device, cwd=out.parent)
    return proc, time.monotonic() - t0


@pytest.fixture(scope="module")
def nan_run(tmp_path_factory):
    """One torchrun where rank 1 feeds a NaN at step 6 (shared by the tests that only read its incident, and with
    test_replicated.py's in one test process: ``rk_testing.ddp_nan_run``)."""
    return ddp_nan_run(tmp_path_factory)


@pytest.fixture(scope="module")
def raise_run(tmp_path_factory):
    """One torchrun where rank 1 raises in its step at step 6 while rank 0 waits in the all-reduce."""
    out = tmp_path_factory.mktemp("raise") / "repros"
    proc, seconds = _torchrun(out, "raise")
    return out, proc, seconds


def _incident(out: Path) -> tuple[Path, list[Path]]:
    folders = [p for p in out.iterdir() if p.is_dir() and p.name.startswith("incident-")]
    assert len(folders) == 1, list(out.iterdir())
    # in rank order (the name ends with rankKofN; it starts with the second it was written, which differs by rank)
    return folders[0], sorted((p for p in folders[0].iterdir() if p.name.startswith("bundle-")),
                              key=lambda p: p.name.rsplit("-", 1)[-1])


@pytest.mark.slow
def test_a_nan_on_one_rank_gives_one_incident_with_every_rank_s_bundle(tmp_path, nan_run):
    out, proc, _ = nan_run
    assert proc.returncode != 0, "training failed"
    folder, bundles = _incident(out)
    assert [b.name.rsplit("-", 1)[-1] for b in bundles] == ["rank0of2", "rank1of2"], bundles
    # Each rank's traceback ends with what to run next: the incident folder (every rank), and its own bundle.
    for b in bundles:
        assert f"reprokit: next: `reprokit replay {folder}` (every rank of the incident" in proc.stderr, proc.stderr
        assert f"`reprokit replay {b}` (this rank alone)" in proc.stderr, proc.stderr
    kinds = {}
    for b in bundles:
        bundle = open_bundle(b)
        d = bundle.run["distributed"]
        assert d["world_size"] == 2 and d["backend"] == "gloo" and d["incident"] == folder.name
        kinds[d["rank"]] = bundle.failure.kind
        assert bundle.failure.step == 6 and bundle.steps[-1] == 6
    # rank 1 fed the NaN; rank 0 received it through the gradient all-reduce
    assert kinds == {1: "nonfinite_loss", 0: "nonfinite_grad"}, kinds
    # One rank alone, in one process (a world of one; DDP's `module.` prefix handled): rank 1 fed the NaN itself, so
    # its failure reproduces; rank 0's came from the other rank's data through the all-reduce, so it cannot.
    alone = CliRunner().invoke(cli, ["replay", str(bundles[1])])
    assert alone.exit_code == 1, alone.output
    assert "recorded on rank 1 of 2, replayed alone" in alone.stdout
    other = CliRunner().invoke(cli, ["replay", str(bundles[0]), "--json"])
    assert other.exit_code in (0, 125), other.output
    assert json.loads(other.stdout)["distributed"]["rank"] == 0
    text = CliRunner().invoke(cli, ["replay", str(bundles[0])])
    # Not bit-exact because its peer is missing, which the note says; the generator/kernel hint would mislead.
    assert "replayed alone" in text.stdout and "hint:" not in text.stdout, text.output
    # Shrink and bisect work on the rank whose failure reproduces alone, and say so on the one whose does not.
    shrunk = CliRunner().invoke(cli, ["shrink", str(bundles[1]), "-o", str(tmp_path / "s1"), "--json"])
    assert shrunk.exit_code == 0 and json.loads(shrunk.stdout)["failure"]["kind"] == "nonfinite_loss", shrunk.output
    layers = CliRunner().invoke(cli, ["bisect", "layers", str(bundles[1]), "--json"])
    assert layers.exit_code == 0 and json.loads(layers.stdout)["first_nonfinite"]["module"] == "0", layers.output
    for argv in (["shrink", str(bundles[0]), "-o", str(tmp_path / "s0")], ["bisect", "steps", str(bundles[0])],
                 ["bisect", "layers", str(bundles[0])], ["bisect", "precision", str(bundles[0]), "--variants", "recorded,fp32"]):
        r = CliRunner().invoke(cli, argv)
        assert r.exit_code == 1, (argv, r.output)
        assert "recorded on rank 0 of 2 and replayed alone" in r.output and "--nproc 2" in r.output, (argv, r.output)
    assert "no single variant" not in r.output and "fp32            pass" in r.output, r.output


@pytest.mark.slow
def test_a_rank_that_raises_leaves_its_peer_blocked_and_both_windows_written(raise_run):
    """Rank 1 raises in its step; rank 0 waits in the all-reduce and never returns. Rank 0's watcher writes its
    window from host memory, long before the 60 s process-group timeout."""
    out, proc, seconds = raise_run
    assert proc.returncode != 0
    assert seconds < 45, f"torchrun took {seconds:.0f} s: the failing rank waited for the timeout"
    folder, bundles = _incident(out)
    assert len(bundles) == 2, bundles
    by_rank = {open_bundle(b).run["distributed"]["rank"]: open_bundle(b) for b in bundles}
    assert by_rank[1].failure.kind == "exception" and by_rank[1].failure.exc_type == "IndexError"
    peer = by_rank[0]
    assert peer.failure.kind == "peer" and peer.failure.step == 6
    assert peer.failure.detail["incident"]["rank"] == 1
    assert peer.steps[-1] == 6, "the window holds the step the rank was blocked in"
    # A peer's bundle alone has nothing to reproduce: replay says so and points at the failing rank.
    r = CliRunner().invoke(cli, ["replay", str(peer.path), "--json"])
    assert r.exit_code == 2, r.output
    assert "did not fail itself" in json.loads(r.stdout)["error"]["message"]


@pytest.mark.slow
def test_a_rank_whose_collective_lost_its_peer_is_not_replayed_alone_as_fixed(raise_run, tmp_path):
    """A peer that dies outside its recorded steps (its data loader raised) leaves this rank a gloo "Connection
    closed by peer" exception and no bundle of its own. Alone, nothing can fail that way: replay said NOT
    REPRODUCED, exit 0, which reads as fixed. The recorded failure is made that one here (on rank 1's bundle)."""
    import shutil

    from rk_testing import reseal

    folder, bundles = _incident(raise_run[0])
    (mine,) = [b for b in bundles if open_bundle(b).run["distributed"]["rank"] == 1]
    shutil.copytree(folder, tmp_path / "incident")  # rank 1's bundle references rank 0's state beside it
    bundle = tmp_path / "incident" / mine.name
    doc = json.loads((bundle / "failure.json").read_text())
    doc.update(exc_type="RuntimeError", message="[../gloo/transport/tcp/pair.cc:553] Connection closed by peer "
               "[127.0.0.1]:22959. This is typically caused by a remote worker crashing.")
    (bundle / "failure.json").write_text(json.dumps(doc))
    reseal(bundle)
    r = CliRunner().invoke(cli, ["replay", str(bundle), "--json"])
    assert r.exit_code == 2, r.output
    message = json.loads(r.stdout)["error"]["message"]
    assert "a collective that lost a peer" in message and "would say nothing about a fix" in message, message
    shrunk = CliRunner().invoke(cli, ["shrink", str(bundle), "-o", str(tmp_path / "small")])
    assert shrunk.exit_code == 1 and "a collective that lost a peer" in shrunk.output, shrunk.output
    # The step's own OSError with the same words (a data loader's socket) is no lost rank: replayed as usual.
    doc.update(exc_type="ConnectionResetError", message="[Errno 104] Connection reset by peer")
    (bundle / "failure.json").write_text(json.dumps(doc))
    reseal(bundle)
    r = CliRunner().invoke(cli, ["replay", str(bundle), "--json"])
    assert r.exit_code != 2 and "lost a peer" not in r.output, r.output
    # A distributed section without an integer world size is an invalid bundle (it was exit 70 on every replay).
    run = json.loads((bundle / "run.json").read_text())
    run["distributed"]["world_size"] = None
    (bundle / "run.json").write_text(json.dumps(run))
    reseal(bundle)
    r = CliRunner().invoke(cli, ["replay", str(bundle), "--json"])
    assert r.exit_code == 3 and "distributed.world_size" in r.output, r.output


@pytest.mark.slow
def test_an_incident_replays_on_two_ranks_and_both_reproduce(tmp_path, nan_run):
    """Replayed alone, rank 0 cannot reproduce (its NaN came from rank 1 through the all-reduce); replayed together,
    with the process group initialised before build(), both ranks fail as recorded."""
    out = nan_run[0]
    folder, _ = _incident(out)
    r = CliRunner().invoke(cli, ["replay", str(folder), "--json"])
    d = json.loads(r.stdout)
    assert r.exit_code == 1 and d["determinism_checked"] is False, r.output
    # Both ranks failed at step 6 in training, and either may have declared the incident first (a race): the report
    # names rank 1, whose own loss went non-finite, not rank 0, whose gradients the all-reduce made non-finite.
    assert d["world_size"] == 2 and d["failing_rank"] == 1 and d["verdict"] == "deterministic", d
    assert d["failing_what"].startswith("non-finite loss at step 6"), d["failing_what"]
    by_rank = {x["rank"]: x for x in d["ranks"]}
    assert by_rank[1]["failure"]["kind"] == "nonfinite_loss" and by_rank[1]["reproduced"]
    assert by_rank[0]["failure"]["kind"] == "nonfinite_grad" and by_rank[0]["reproduced"], by_rank[0]
    bad = CliRunner().invoke(cli, ["replay", str(folder), "--nproc", "3"])
    assert bad.exit_code == 2 and "recorded on 2 ranks" in bad.output
    # --code: every rank imports build/step from a checkout; one without the project is refused before any rank runs.
    # The human text (one launch for both: the JSON run above took the bundles' own code): exit 1 with "reproduced
    # once" on the incident's line is the verdict deterministic of a single run (verdict_phrase), on every rank.
    human = CliRunner().invoke(cli, ["replay", str(folder), "--nproc", "2", "--code", str(PROJECTS),
                                     *entries(_incident(out)[1][0])])
    assert human.exit_code == 1 and "rank 0: reproduced once (recorded" in human.stdout, human.output
    assert ": rank 1 failed in training (non-finite loss at step 6" in human.stdout, human.output
    assert "replayed on 2 ranks: reproduced once" in human.stdout, human.output
    assert "rank 1: reproduced once (recorded nonfinite_loss" in human.stdout, human.output
    empty = tmp_path / "empty-checkout"
    empty.mkdir()
    refused = CliRunner().invoke(cli, ["replay", str(folder), "--code", str(empty)])
    assert refused.exit_code == 125 and "does not hold the bundle's code" in refused.output, refused.output
    # Each rank checks --entry again on the bundle it opens itself (the folder may change after the CLI's check): a
    # ref not confirmed makes that rank an error, never a run of code the user did not name.
    from reprokit.distributed.incident import replay_incident
    report = replay_incident(folder, code=PROJECTS, entries=["step=nothing:here"])
    assert report.verdict == "error" and report.exit_code == 125, report.to_json()
    assert all("not confirmed with --entry" in x["error"] for x in report.to_json()["ranks"]), report.to_json()


@pytest.mark.slow
def test_an_incident_whose_rank_raised_replays_with_the_peer_blocked(raise_run, tmp_path, monkeypatch):
    out = raise_run[0]
    folder, _ = _incident(out)
    system_tmp = tmp_path / "system-tmp"
    system_tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(system_tmp))  # what the rank processes take as their temp folder
    r = CliRunner().invoke(cli, ["replay", str(folder), "--json"])
    # a rank blocked in a collective leaves with os._exit: its private code copy must not stay behind
    assert not list(system_tmp.glob("reprokit-code-*")), list(system_tmp.iterdir())
    d = json.loads(r.stdout)
    assert r.exit_code == 1 and d["verdict"] == "deterministic", d
    by_rank = {x["rank"]: x for x in d["ranks"]}
    assert by_rank[1]["failure"]["exception_type"] == "IndexError"
    # rank 0 waits in the all-reduce that rank 1 never joins: either it is still blocked when rank 1 has reported
    # (the replay marks it so), or the transport notices rank 1's exit and raises in its step (another failure)
    peer = by_rank[0]
    assert peer.get("blocked") or (peer["verdict"] == "different_failure" and peer["failure"]["step"] == 6), peer


two_gpus = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.device_count() >= 2),
                              reason="needs two CUDA devices (run on the 2-GPU machine)")


def _public_fsdp2() -> bool:
    """torch >= 2.6, read from its version (importing torch.distributed.fsdp at collection costs every test process
    a second)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 6) and torch.distributed.is_available()


# torch < 2.6 has FSDP2 only as torch.distributed._composable.fsdp, which makes CUDA streams even on the CPU (seen
# with torch 2.4.1: "CUDA driver version is insufficient"); reprokit reads its DTensors there too (pytree).
fsdp2_on_cpu = pytest.mark.skipif(not _public_fsdp2(), reason="FSDP2 on the CPU needs torch >= 2.6 (public fully_shard)")


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=fsdp2_on_cpu),
                                    pytest.param("cuda", marks=[pytest.mark.cuda, two_gpus])])
@pytest.mark.slow
def test_an_fsdp2_incident_keeps_each_rank_s_shards_and_replays_on_two_ranks(tmp_path, device, monkeypatch):
    """FSDP2 (fully_shard, gloo): every rank holds half of each parameter and of AdamW's state. Each bundle carries
    its rank's shards and their layout; replayed on two ranks (build() shards the model again), both reproduce
    bit-exactly. Replayed alone, the shards mean nothing: refused before build(), pointing at the incident."""
    monkeypatch.setenv("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0")  # under NCCL: else the Recorder warns of its watchdog
    out = tmp_path / "repros"
    proc = torchrun(PROJECTS / "rk_fsdp.py", out, device, cwd=tmp_path)
    # the run ends in reprokit's TrainingFailure, and the recorder itself had no trouble with DTensors
    assert proc.returncode != 0 and "TrainingFailure" in proc.stderr, proc.stderr[-3000:]
    assert "RecorderWarning" not in proc.stderr, proc.stderr[-3000:]
    folder, bundles = _incident(out)
    assert len(bundles) == 2, bundles
    for b in bundles:
        tree, tensors = open_bundle(b).state()
        shards = tree["state"]["shards"]
        assert shards["model/0.weight"] == {"placements": ["Shard(dim=0)"], "shape": [16, 8], "local_shape": [8, 8],
                                            "mesh_shape": [2]}, shards
        assert tuple(tensors["model/0.weight"].shape) == (8, 8)
        assert any(k.startswith("optimizer/state/") and k.endswith("exp_avg") for k in shards), sorted(shards)
    r = CliRunner().invoke(cli, ["replay", str(folder), "--device", device, "--json"])
    d = json.loads(r.stdout)
    assert r.exit_code == 1 and d["verdict"] == "deterministic", r.output
    for x in d["ranks"]:
        assert x["reproduced"] and x["fidelity"]["bit_exact"], x
    alone = CliRunner().invoke(cli, ["replay", str(bundles[1])])
    assert alone.exit_code == 125, alone.output
    assert "shards of a sharded (FSDP2) state" in alone.output and "--nproc 2" in alone.output


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("mode", ["assert", "assert_with"])
@pytest.mark.slow
def test_nccl_a_device_side_assert_on_one_rank_gives_every_rank_s_bundle(tmp_path, mode, monkeypatch):
    """Rank 1 indexes past a tensor's end at step 6: a device-side assert that poisons its CUDA context and surfaces
    later (at a copy in the loop's own code, outside the recorder: the late path, through the excepthook or
    ``with Recorder``), while rank 0 waits in an NCCL all-reduce. With NCCL's watchdog told not to abort the process
    on a CUDA error, rank 1 writes its window from host memory and rank 0 its own, in one incident."""
    monkeypatch.setenv("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0")
    out = tmp_path / "repros"
    proc, seconds = _torchrun(out, mode, "cuda")
    assert proc.returncode != 0 and seconds < 60, (seconds, proc.stderr[-3000:])
    assert "TORCH_NCCL_RETHROW_CUDA_ERRORS" not in proc.stderr, "the warning is for jobs that leave it on"
    folder, bundles = _incident(out)
    assert len(bundles) == 2, (bundles, proc.stderr[-3000:])
    by_rank = {open_bundle(b).run["distributed"]["rank"]: (b, open_bundle(b)) for b in bundles}
    path1, one = by_rank[1]
    assert one.failure.kind == "device_error" and one.failure.step == 6, (one.failure, proc.stderr[-3000:])
    assert "device-side assert" in one.failure.message, one.failure.message
    assert one.steps[-1] == 6 and one.step(6)[0]["idx"].tolist() == [99], one.steps
    assert by_rank[0][1].failure.kind == "peer", by_rank[0][1].failure
    print(f"\n{mode}: torchrun ended {seconds:.1f} s after it started; rank 1's error surfaced at step "
          f"{one.failure.detail['device_error'].get('surfaced_at_step')}")
    # Rank 1 alone: on the CPU the same index is an IndexError at step 6, and the GPU confirms it in a child process.
    r = CliRunner().invoke(cli, ["replay", str(path1), "--json"])
    d = json.loads(r.stdout)
    assert r.exit_code == 1 and d["triage"]["reproduced_as"] == "device_error", (r.exit_code, d)
    assert d["triage"]["cpu"]["cpu_face"] and d["triage"]["gpu"]["checked"], d["triage"]


@pytest.mark.cuda
@two_gpus
@pytest.mark.slow
def test_nccl_s_watchdog_aborts_a_rank_on_a_device_error_and_the_durable_window_recovers_it(tmp_path, monkeypatch):
    """NCCL's default: its watchdog thread aborts rank 1 as soon as it sees the CUDA error, mostly before rank 1's
    bundle is written, and torchrun stops rank 0. Rank 0's Recorder warned of it at the start, naming the setting; with
    ``durable=True`` both windows are on disk, and ``reprokit recover`` makes them bundles."""
    monkeypatch.delenv("TORCH_NCCL_RETHROW_CUDA_ERRORS", raising=False)
    out = tmp_path / "repros"
    proc, seconds = _torchrun(out, "assert_durable", "cuda")
    assert proc.returncode != 0 and seconds < 60, (seconds, proc.stderr[-3000:])
    assert "Set TORCH_NCCL_RETHROW_CUDA_ERRORS=0" in proc.stderr, proc.stderr[-3000:]
    assert "watchdog thread terminated with exception" in proc.stderr, proc.stderr[-3000:]
    r = CliRunner().invoke(cli, ["recover", str(out), "--json"])
    print(f"\ntorchrun ended after {seconds:.1f} s; recover exit {r.exit_code}: {r.stdout[:3000]}")
    assert r.exit_code == 0, r.output
    written = sorted(out.rglob("bundle-*-rank*of2"))
    ranks = {open_bundle(b).run["distributed"]["rank"]: open_bundle(b) for b in written}
    assert set(ranks) == {0, 1}, (written, r.stdout)
    status = {d["rank"]: d["status"] for d in json.loads(r.stdout)["runs"][0]["ranks"]}
    # Rank 1: the watchdog and rank 1's own recorder race. Mostly the watchdog aborts it before its window is written
    # (recovered from the durable log: a SIGABRT crash); sometimes rank 1 writes its device-error bundle first (seen
    # on 2x H200), which recover leaves as it is.
    one = ranks[1].failure
    if status[1] == "already_written":
        assert one.kind == "device_error" and "device-side assert" in one.message, one
    else:
        assert status[1] == "recovered" and (one.kind, one.exc_type) == ("crash", "SIGABRT"), (status, one)
    assert status[0] == "recovered", status
    assert (ranks[0].failure.kind, ranks[0].failure.exc_type) == ("crash", "SIGTERM"), ranks[0].failure
    assert 6 in ranks[1].steps and ranks[1].step(6)[0]["idx"].tolist() == [99], ranks[1].steps


@pytest.mark.slow
def test_inspect_json_names_rank_world_and_incident(nan_run):
    out = nan_run[0]
    folder, bundles = _incident(out)
    d = json.loads(CliRunner().invoke(cli, ["inspect", str(bundles[1]), "--json"]).stdout)
    assert (d["rank"], d["world_size"], d["incident"]) == (1, 2, folder.name), d


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("mode", ["nan", "raise"])
@pytest.mark.slow
def test_nccl_incidents_on_two_gpus(tmp_path, mode):
    """The same two cases under NCCL: a rank blocked in an NCCL all-reduce keeps its GPU stream busy forever, so its
    watcher must write the window without synchronizing the device."""
    out = tmp_path / "repros"
    proc, seconds = _torchrun(out, mode, "cuda")
    assert proc.returncode != 0 and seconds < 50, (seconds, proc.stderr[-3000:])
    folder, bundles = _incident(out)
    assert len(bundles) == 2, (bundles, proc.stderr[-3000:])
    by_rank = {open_bundle(b).run["distributed"]["rank"]: open_bundle(b) for b in bundles}
    assert by_rank[0].run["distributed"]["backend"] == "nccl"
    if mode == "nan":
        assert (by_rank[1].failure.kind, by_rank[0].failure.kind) == ("nonfinite_loss", "nonfinite_grad")
        r = CliRunner().invoke(cli, ["replay", str(folder), "--device", "cuda", "--json"])
        d = json.loads(r.stdout)
        assert r.exit_code == 1 and all(x.get("reproduced") for x in d["ranks"]), d
    else:
        assert by_rank[1].failure.exc_type == "IndexError" and by_rank[0].failure.kind == "peer"
        assert by_rank[0].steps, "the peer's window holds the steps whose copies had landed"
