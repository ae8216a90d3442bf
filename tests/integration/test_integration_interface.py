"""The public interface a framework integration is written against: ``begin_step``/``end_step`` around a step the
framework runs itself, ``request_snapshot`` after a change ``train_step`` cannot replay, and ``carry`` for the
project's classes its ``build`` names. The integration under test (tests/projects/rk_own_trainer.py) uses nothing
private, and its bundles replay bit-exact from their own code snapshot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from rk_testing import bundle_of

import reprokit
from reprokit import bundle as B
from reprokit.errors import ConfigError


def fit(projects, tmp_path: Path, n: int, poison_step: int | None, **kw) -> tuple[object, BaseException | None]:
    own, model = projects("rk_own_trainer"), projects("rk_own_model")
    lr_cut_at = kw.pop("lr_cut_at", None)
    trainer = own.OwnTrainer(model.Net, tmp_path / "repros", snapshot_every=kw.pop("snapshot_every", 4), **kw)
    try:
        trainer.fit(own.batches(n, poison_step), lr_cut_at=lr_cut_at)
    except Exception as e:  # noqa: BLE001 - the test looks at what came out
        return trainer, e
    finally:
        trainer.recorder.close()
    return trainer, None


@pytest.mark.slow
def test_an_integration_on_the_public_interface_writes_a_bundle_that_carries_its_model_class(projects, tmp_path,
                                                                                             fork_server):
    _, exc = fit(projects, tmp_path, 12, poison_step=9)
    assert isinstance(exc, reprokit.TrainingFailure)
    bundle = bundle_of(exc)
    assert B.verify(bundle) == []
    run = json.loads((bundle / "run.json").read_text())
    assert run["refs"]["build"]["module"] == "rk_own_trainer"
    assert {"module": "rk_own_model", "qualname": "Net"} in run["refs"]["objects"]
    assert (bundle / "code" / "rk_own_model.py").is_file(), "the carried class's file is in the code snapshot"

    # Replay imports the model class from the bundle's snapshot: moved away from the project, in a process where the
    # test projects are not importable (forked from the fork server, which never imported them), it still replays.
    moved = shutil.copytree(bundle, tmp_path / "elsewhere" / bundle.name)
    proc = fork_server.reprokit("replay", moved, "--times", "2", "--json", "--trust")
    assert proc.returncode == 1, proc.stderr
    d = json.loads(proc.stdout)
    assert d["verdict"] == "deterministic" and d["failure"]["step"] == 9 and d["fidelity"]["bit_exact"]


def test_an_lr_change_between_steps_with_request_snapshot_starts_a_window_that_replays_bit_exact(projects, tmp_path):
    _, exc = fit(projects, tmp_path, 12, poison_step=10, snapshot_every=100, lr_cut_at=7)
    bundle = bundle_of(exc)
    window = json.loads((bundle / "run.json").read_text())["window"]
    assert window["start"] == 7 and window["steps"] == [7, 8, 9, 10], "the window starts at the requested snapshot"
    report = reprokit.replay(bundle)
    assert report.reproduced and report.to_json()["fidelity"]["bit_exact"]


def test_a_run_with_the_interface_trains_bit_identically_to_the_bare_loop(projects, tmp_path):
    own = projects("rk_own_trainer")
    trainer, exc = fit(projects, tmp_path, 10, poison_step=None)
    assert exc is None and trainer.recorder.step_index == 10
    state = own.build({"model": {"module": "rk_own_model", "qualname": "Net"}})
    for batch in own.batches(10):
        own.train_step(state, batch)
    for (name, a), b in zip(trainer.state.model.state_dict().items(), state.model.state_dict().values()):
        assert torch.equal(a, b), name


def test_an_exception_inside_the_framework_step_is_reraised_unchanged_with_the_bundle_note(projects, tmp_path):
    own, model = projects("rk_own_trainer"), projects("rk_own_model")
    trainer = own.OwnTrainer(model.Net, tmp_path / "repros", snapshot_every=4)
    rec = trainer.recorder
    bad = {"x": torch.randn(8, 5), "y": torch.zeros(8, 1)}  # the wrong width: the Linear layer raises
    rec.begin_step(own.batches(1)[0])
    rec.end_step(own.train_step(trainer.state, own.batches(1)[0]))
    rec.begin_step(bad)
    with pytest.raises(RuntimeError) as info:
        try:
            own.train_step(trainer.state, bad)
        except RuntimeError as e:
            rec.end_step(exc=e)
    assert any("bundle written to" in n for n in info.value.__notes__)
    assert reprokit.replay(bundle_of(info.value)).reproduced
    rec.close()


def test_steps_opened_and_closed_out_of_order_are_refused_with_a_clear_message(projects, tmp_path):
    own, model = projects("rk_own_trainer"), projects("rk_own_model")
    trainer = own.OwnTrainer(model.Net, tmp_path / "repros")
    rec = trainer.recorder
    with pytest.raises(ConfigError, match="no step open"):
        rec.end_step(torch.tensor(1.0))
    rec.begin_step(own.batches(1)[0])
    assert rec.in_step
    with pytest.raises(ConfigError, match="is open"):
        rec.begin_step(own.batches(1)[0])
    rec.end_step(own.train_step(trainer.state, own.batches(1)[0]))
    assert not rec.in_step and rec.step_index == 1
    rec.close()


def test_carry_refuses_what_replay_could_not_import(projects, tmp_path):
    own = projects("rk_own_trainer")
    state = own.build({"model": {"module": "rk_own_model", "qualname": "Net"}})
    with pytest.raises(reprokit.CaptureError, match="carry"):
        reprokit.Recorder(state, own.train_step, build=own.build, out_dir=tmp_path, carry=(lambda: None,))
    assert not state.optimizer._optimizer_step_pre_hooks, "a refused Recorder leaves no hook on the optimizer"


def test_a_durable_run_s_flight_log_holds_the_carried_class_and_its_file(projects, tmp_path):
    own, model = projects("rk_own_trainer"), projects("rk_own_model")
    trainer = own.OwnTrainer(model.Net, tmp_path / "repros", durable=True)
    try:
        trainer.fit(own.batches(2))
        runs = list((tmp_path / "repros").glob(".reprokit-flight/*/*/run.json"))
        assert len(runs) == 1, sorted(p.relative_to(tmp_path) for p in (tmp_path / "repros").rglob("*"))
        assert {"module": "rk_own_model", "qualname": "Net"} in json.loads(runs[0].read_text())["refs"]["objects"]
        assert (runs[0].parent / "code" / "rk_own_model.py").is_file()
    finally:
        trainer.recorder.close()
