"""Recorder(durable=True) and `reprokit recover`: real training processes that die (SIGKILL, a segfault, an abort,
a kill from outside), real flight logs on disk, real bundles checked with `reprokit verify`."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rk_forked import ForkedRuns

import reprokit
from reprokit.bundle import open_bundle, verify
from reprokit.cli import main
from reprokit.errors import ConfigError, RecorderWarning
from reprokit.flight import FLIGHT_DIR
from reprokit.report import format_incident

ROOT = Path(__file__).resolve().parents[2]
MARKER = 12345.0
SCRIPT = (ROOT / "tests" / "projects" / "rk_durable_die.py").read_text()


ONE_THREAD = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def forked(fork_server):
    """The server that imported torch forks every training run (a real process each, one thread: ``ONE_THREAD``)."""
    return fork_server


def _train(forked: ForkedRuns, tmp_path: Path, crash_step: int, **extra: str) -> subprocess.CompletedProcess[str]:
    """Run the training script (forked, see tests/rk_forked.py) in ``tmp_path``; its output in stdout and stderr."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    code = forked.run(script, [str(tmp_path / "out"), str(crash_step)], cwd=tmp_path, env={**ONE_THREAD, **extra})
    log = (tmp_path / "run.log").read_text()
    return subprocess.CompletedProcess([str(script)], code, log, log)


@pytest.fixture(scope="module")
def killed_in_step_37(forked, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One run of the script that SIGKILLs itself in step 37, left as it died (its folder: the script, its log and
    ``out/`` holding the flight log); only copied from (``died_in_step_37``), never changed."""
    where = tmp_path_factory.mktemp("killed37")
    return where, _train(forked, where, 37, DIE_HOW="kill")


@pytest.fixture
def died_in_step_37(killed_in_step_37, tmp_path) -> subprocess.CompletedProcess[str]:
    """``tmp_path`` as the run that SIGKILLed itself in step 37 left it (a copy of ``killed_in_step_37``'s folder,
    free to change: recover it, cut its log); what the run exited with and printed."""
    where, proc = killed_in_step_37
    shutil.copytree(where, tmp_path, symlinks=True, dirs_exist_ok=True)
    return proc


def _reprokit(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``reprokit ARGS`` in this process (click's CliRunner): the CLI's own code, without a torch import."""
    old = Path.cwd()
    os.chdir(cwd)
    try:
        r = CliRunner().invoke(main, list(args))
    finally:
        os.chdir(old)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(["reprokit", *args], r.exit_code, r.stdout, r.stderr)


def _recover(tmp_path: Path) -> dict:
    r = _reprokit("recover", str(tmp_path / "out"), "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_a_run_that_sigkills_itself_in_step_37_recovers_to_a_bundle_ending_at_step_37(died_in_step_37, tmp_path):
    proc = died_in_step_37
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert list((tmp_path / "out").glob("bundle-*")) == []  # nothing but the flight log: no Python frame caught it

    d = _recover(tmp_path)
    [run] = d["runs"]
    assert run["status"] == "recovered", run
    bundle = Path(run["bundle"])
    assert verify(bundle) == []
    b = open_bundle(bundle)
    f = b.failure
    assert (f.kind, f.step, f.exc_type) == ("crash", 37, None)
    assert "no error recorded" in f.message and "SIGKILL" in f.message
    assert f.detail["last_started"] == 37 and f.detail["last_finished"] == 36
    assert b.run["window"] == {"start": 30, "end": 37, "steps": list(range(30, 38))}
    batch, _, _ = b.step(37)
    assert (batch["x"] == MARKER).nonzero().tolist() == [[3, 2]]
    assert not (tmp_path / "out" / FLIGHT_DIR).exists()

    shown = _reprokit("inspect", str(bundle), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "crash at step 37" in shown.stdout

    again = _recover(tmp_path)  # idempotent: the flight log went with the first recover
    assert again["written"] == [] and "no flight log" in again["nothing_to_recover"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_a_cuda_run_killed_in_step_37_recovers_every_batch_its_writer_thread_wrote_bit_for_bit(forked, tmp_path):
    """CUDA batches reach the host after their step's kernels: the flight log's writer thread frames each step's
    record while the step runs and hashes and writes it once the copy has landed. Step 37 dies before its copy is
    even queued, so the recovered window ends before it (step 37 named as started, its batch lost), and every batch
    in it is the one the run fed, read after its copy landed (a record read too early would not match its own
    digest, or would hold stale data)."""
    proc = _train(forked, tmp_path, 37, DIE_HOW="kill", DEVICE="cuda")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    [run] = _recover(tmp_path)["runs"]
    assert run["status"] == "recovered", run
    b = open_bundle(run["bundle"])
    assert verify(b.path) == []
    # Step 36's record is written once its copy lands, on the writer thread, racing step 37's death: at most that
    # step is lost with it.
    end = b.run["window"]["end"]
    assert end in (35, 36) and b.run["window"] == {"start": 30, "end": end, "steps": list(range(30, end + 1))}
    assert (b.failure.kind, b.failure.step, b.failure.detail["last_started"]) == ("crash", end, 37)
    assert "asynchronous GPU copy" in b.failure.detail["dropped"], b.failure.detail
    g = torch.Generator().manual_seed(1)  # the script's batches, made again
    fed = {}
    for step in range(37):
        fed[step] = (torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))
    for step in range(30, end + 1):
        batch, _, _ = b.step(step)
        assert torch.equal(batch["x"].cpu(), fed[step][0]) and torch.equal(batch["y"].cpu(), fed[step][1]), step


@pytest.mark.parametrize(("how", "signame", "code"), [("segv", "SIGSEGV", -signal.SIGSEGV),
                                                      ("abort", "SIGABRT", -signal.SIGABRT)])
def test_a_segfault_or_an_abort_in_step_37_is_named_from_the_fault_log(forked, tmp_path, how, signame, code):
    proc = _train(forked, tmp_path, 37, DIE_HOW=how)
    assert proc.returncode == code, proc.stderr
    [run] = _recover(tmp_path)["runs"]
    assert run["status"] == "recovered", run
    b = open_bundle(run["bundle"])
    assert (b.failure.kind, b.failure.step, b.failure.exc_type) == ("crash", 37, signame)
    assert b.failure.message == f"the process died with {signame} during step 37"
    assert "Fatal Python error" in b.failure.detail["fault_log"]
    assert b.failure.detail["signal"] == signame


def test_a_durable_run_keeps_at_most_two_windows_and_leaves_nothing_after_close(forked, tmp_path):
    proc = _train(forked, tmp_path, -1, STEPS="45")
    assert proc.returncode == 0, proc.stderr
    assert "windows at most 2; after close False" in proc.stdout
    assert not (tmp_path / "out" / FLIGHT_DIR).exists()


def test_a_torn_last_record_gives_the_longest_consistent_prefix_and_says_what_was_dropped(died_in_step_37,
                                                                                          tmp_path):
    proc = died_in_step_37
    assert proc.returncode == -signal.SIGKILL
    [log] = (tmp_path / "out" / FLIGHT_DIR).glob("*/rank0/win-00000030/log")
    size = log.stat().st_size
    with open(log, "r+b") as f:  # step 37's record is the last one: cut it in the middle
        f.truncate(size - 3000)
    [run] = _recover(tmp_path)["runs"]
    assert run["status"] == "recovered", run
    b = open_bundle(run["bundle"])
    assert b.run["window"]["end"] == 36 and b.failure.step == 36
    dropped = b.failure.detail["dropped"]
    assert "cut short" in dropped and "win-00000030/log" in dropped
    assert run["ranks"][0]["dropped"] == dropped
    assert verify(Path(run["bundle"])) == []


def test_a_flight_log_without_a_usable_snapshot_gives_nothing_to_recover_with_why(died_in_step_37, tmp_path):
    proc = died_in_step_37
    assert proc.returncode == -signal.SIGKILL
    for state in (tmp_path / "out" / FLIGHT_DIR).glob("*/rank0/win-*/state-0.safetensors"):
        state.unlink()
    d = _recover(tmp_path)
    assert d["written"] == []
    assert d["runs"][0]["status"] == "nothing_to_recover"
    assert "lacks state-0.safetensors" in d["runs"][0]["why"]
    assert list((tmp_path / "out").glob("bundle-*")) == []


def test_replay_and_inspect_given_the_out_dir_recover_first_and_say_so(died_in_step_37, tmp_path):
    proc = died_in_step_37
    assert proc.returncode == -signal.SIGKILL
    shown = _reprokit("inspect", str(tmp_path / "out"), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    assert "reprokit: recovered" in shown.stderr and "crash at step 37" in shown.stdout


@pytest.mark.slow
def test_kills_from_outside_at_random_moments_give_valid_bundles_or_nothing_to_recover(forked, tmp_path):
    from reprokit.isolation import IsolatedRunner

    rng = random.Random(20261127)
    seen = {"recovered": 0, "nothing_to_recover": 0}
    with IsolatedRunner() as replays:  # one torch import for the replays of all the recovered bundles
        for i in range(20):
            case = tmp_path / f"kill{i}"
            case.mkdir()
            (case / "train.py").write_text(SCRIPT)
            ready = case / "ready"
            pid = forked.start(case / "train.py", [str(case / "out"), "-1"], cwd=case,
                               env={**ONE_THREAD, "STEPS": "100000", "PAUSE": "0.002", "READY": str(ready)})
            deadline = time.monotonic() + 120
            while not ready.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert ready.exists(), (case / "run.log").read_text()
            # Half the kills land in the first steps (the first snapshot may not be on disk yet), half later.
            time.sleep(rng.uniform(0.0, 0.05) if i % 2 else rng.uniform(0.05, 1.5))
            os.kill(pid, signal.SIGKILL)
            assert forked.wait() == -signal.SIGKILL, (case / "run.log").read_text()
            d = _recover(case)
            [run] = d["runs"]
            assert run["status"] in seen, run
            seen[run["status"]] += 1
            if run["status"] == "recovered":
                assert verify(Path(run["bundle"])) == [], run
                b = open_bundle(run["bundle"])
                assert b.failure.kind == "crash" and b.failure.step == b.run["window"]["end"]
                # The step did nothing that kills: its replay runs clean, never "reproduced" (nor another failure).
                outcome = replays.attempt(b.path, recorded=b.failure).outcome
                assert outcome.failure is None and not outcome.same, (run, outcome)
            else:
                assert run["why"].startswith("nothing to recover: ") and len(run["why"]) > 30
                assert list((case / "out").glob("bundle-*")) == []
    assert seen["recovered"] >= 10, seen


def _tiny_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _tiny_build(config):
    return _tiny_state()


def _tiny_step(state, batch):
    loss = state.model(batch).pow(2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss


def _train_in_process(out: Path, durable: bool) -> list[torch.Tensor]:
    state = _tiny_state()
    g = torch.Generator().manual_seed(3)
    with reprokit.Recorder(state, _tiny_step, build=_tiny_build, out_dir=out, snapshot_every=4,
                           durable=durable) as rec:
        for _ in range(11):
            rec.step(torch.randn(5, 3, generator=g))
        if durable:
            assert rec._flight is not None and len(rec._flight.windows_on_disk()) <= 2
    return [p.detach().clone() for p in state.model.parameters()]


def test_durable_recording_leaves_training_bit_identical_and_nothing_on_disk(tmp_path):
    plain = _train_in_process(tmp_path / "plain", durable=False)
    durable = _train_in_process(tmp_path / "durable", durable=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, durable))
    assert not (tmp_path / "durable" / FLIGHT_DIR).exists()


def test_a_flight_folder_that_cannot_be_made_warns_and_training_goes_on(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / FLIGHT_DIR).write_text("a file where the flight folder goes")
    state = _tiny_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = reprokit.Recorder(state, _tiny_step, build=_tiny_build, out_dir=out, snapshot_every=4, durable=True)
        for _ in range(5):
            rec.step(torch.randn(5, 3))
        rec.close()
    assert any(issubclass(w.category, RecorderWarning) and "durable recording is off" in str(w.message)
               for w in caught)


def test_durable_refuses_a_replicated_state_it_cannot_record_alone(tmp_path):
    with pytest.raises(ConfigError, match="durable=True records every rank's own state"):
        reprokit.Recorder(_tiny_state(), _tiny_step, build=_tiny_build, out_dir=tmp_path, durable=True,
                          replicated_state=True)


DDP_SCRIPT = textwrap.dedent('''
    """Two ranks (gloo), durable recording; rank 1 SIGKILLs itself in step 17."""
    import os
    import signal
    import sys

    import torch
    import torch.distributed as dist

    import reprokit


    def build(config):
        torch.manual_seed(config["seed"])
        model = torch.nn.Linear(4, 1)
        if dist.is_initialized():
            model = torch.nn.parallel.DistributedDataParallel(model)
        return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.01))


    def train_step(state, batch):
        if dist.get_rank() == 1 and bool((batch["x"] == 999.0).any()):
            os.kill(os.getpid(), signal.SIGKILL)
        loss = torch.nn.functional.mse_loss(state.model(batch["x"]), batch["y"])
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        return loss


    if __name__ == "__main__":
        dist.init_process_group("gloo")
        cfg = {"seed": 0}
        state = build(cfg)
        g = torch.Generator().manual_seed(10 + dist.get_rank())
        rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=sys.argv[1], snapshot_every=5,
                                durable=True, incident_wait_s=5)
        for step in range(30):
            x = torch.randn(8, 4, generator=g)
            if step == 17:
                x[0, 0] = 999.0
            rec.step({"x": x, "y": torch.randn(8, 1, generator=g)})
        rec.close()
        dist.destroy_process_group()
''')


@pytest.mark.slow
def test_two_ranks_under_torchrun_rank1_killed_in_step_17_recover_to_one_incident_folder(tmp_path):
    from rk_testing import torchrun

    from reprokit.distributed.incident import describe_incident, rank_bundles

    (tmp_path / "train_ddp.py").write_text(DDP_SCRIPT)
    proc = torchrun(tmp_path / "train_ddp.py", tmp_path / "out", cwd=tmp_path, timeout=300)
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-3000:]
    d = _recover(tmp_path)
    [run] = d["runs"]
    assert run["status"] == "recovered", run
    folder = Path(run["incident"])
    assert folder.parent == tmp_path / "out" and folder.name.startswith("incident-")
    bundles = rank_bundles(folder)  # every rank once, one world size, windows starting at one step
    assert sorted(bundles) == [0, 1]
    one = bundles[1]
    assert (one.failure.kind, one.failure.step, one.failure.exc_type) == ("crash", 17, None)
    assert one.failure.detail["rank"] == 1 and one.failure.detail["world_size"] == 2
    assert one.run["window"]["end"] == 17 and one.run["distributed"]["incident"] == folder.name
    batch, _, _ = one.step(17)
    assert bool((batch["x"] == 999.0).any())
    assert all(verify(b.path) == [] for b in bundles.values())
    assert describe_incident(folder)["failing_rank"] == 1
    shown = _reprokit("inspect", str(folder), cwd=tmp_path)
    assert shown.returncode == 0 and "rank 1 failed first" in shown.stdout, shown.stdout + shown.stderr

    # Both ranks replayed together: rank 1's replay dies with SIGKILL in step 17 again (its rank process forks the
    # replay and reports the death); rank 0's all-reduce then loses its peer. The verdict is rank 1's.
    r = _reprokit("replay", str(folder), "--nproc", "2", "--json", cwd=tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert (d["verdict"], d["failing_rank"], d["reproduced"]) == ("deterministic", 1, True), d
    rank0, rank1 = d["ranks"]
    assert (rank1["failure"]["kind"], rank1["failure"]["step"], rank1["failure"]["exception_type"]) == (
        "crash", 17, "SIGKILL"), rank1
    assert rank1["per_run"][0]["death"]["returncode"] == -signal.SIGKILL
    assert rank1["per_run"][0]["fidelity"]["bit_exact"], rank1  # steps 15 and 16 ran as recorded first
    assert rank0["verdict"] in ("different_failure", "blocked"), rank0  # gloo's error, or still waiting for rank 1
    assert "rank 1: reproduced once (recorded crash, replayed crash (the process died with SIGKILL at step 17))" \
        in format_incident(d), format_incident(d)
