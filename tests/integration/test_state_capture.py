"""Every common torch optimizer, LR scheduler and GradScaler survives record -> bundle -> replay exactly."""

from __future__ import annotations

import warnings

import pytest
import torch
from rk_testing import record

import reprokit
from reprokit.bundle import open_bundle

OPTIMIZERS = ["sgd", "adam", "adamw", "adamw_amsgrad", "rmsprop", "adagrad", "adadelta", "adamax", "nadam", "radam",
              "asgd", "rprop", "lbfgs"]
SCHEDULERS = ["lambda", "step", "cosine", "onecycle", "sequential"]


def _assert_bit_exact_replay(mlp, cfg, tmp_path, steps=16, poison=13, every=5):
    _, exc = record(mlp, cfg, mlp.batches(cfg, steps, poison_step=poison), tmp_path, snapshot_every=every)
    assert isinstance(exc, reprokit.TrainingFailure), exc
    report = reprokit.replay(exc.bundle)
    assert report.reproduced and report.runs[0].failure.step == poison
    # Bit-exact losses over the window prove the optimizer/scheduler/scaler state came back exactly.
    assert report.fidelity["bit_exact"] and report.fidelity["steps_compared"] == poison - (poison // every) * every + 1
    return exc.bundle


# A few kinds in the quick run (momentum, Adam's moments, LBFGS's closure; a per-step and a nested schedule), the
# rest under the slow marker: each case records and replays, about a second apiece.
QUICK_OPTIMIZERS = {"sgd", "adamw", "lbfgs"}
QUICK_SCHEDULERS = {"onecycle", "sequential"}


@pytest.mark.parametrize("opt", [o if o in QUICK_OPTIMIZERS else pytest.param(o, marks=pytest.mark.slow)
                                 for o in OPTIMIZERS])
def test_optimizer_state_round_trips(projects, tmp_path, opt):
    _assert_bit_exact_replay(projects("rk_mlp"), {"optimizer": opt, "lr": 1e-2}, tmp_path)


@pytest.mark.parametrize("sched", [s if s in QUICK_SCHEDULERS else pytest.param(s, marks=pytest.mark.slow)
                                   for s in SCHEDULERS])
def test_scheduler_state_round_trips(projects, tmp_path, sched):
    path = _assert_bit_exact_replay(projects("rk_mlp"), {"optimizer": "adamw", "scheduler": sched, "steps": 16},
                                    tmp_path)
    assert open_bundle(path).state()[0]["state"]["scheduler"]["last_epoch"] == 10


def test_gradscaler_state_round_trips(projects, tmp_path):
    path = _assert_bit_exact_replay(projects("rk_mlp"), {"optimizer": "adam", "scaler": True, "init_scale": 1024.0},
                                    tmp_path)
    assert open_bundle(path).state()[0]["state"]["scaler"]["scale"] > 0


def test_tied_weights(projects, tmp_path):
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "adamw", "tied": True}
    path = _assert_bit_exact_replay(mlp, cfg, tmp_path)
    with reprokit.Session(open_bundle(path)) as s:
        s.restore()
        assert s.state.model.inp.weight is s.state.model.out.weight, "tying survives restore"


def test_recorder_does_not_change_training(projects, tmp_path):
    """200 steps with and without the recorder: parameters and optimizer state bit-identical."""
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "adamw", "scheduler": "cosine", "steps": 200}

    def train(with_recorder: bool):
        state = mlp.build(cfg)
        step = mlp.train_step
        if with_recorder:
            rec = reprokit.Recorder(state, mlp.train_step, build=mlp.build, config=cfg, out_dir=tmp_path,
                                    snapshot_every=30, check_params=True, spike_factor=100.0)
            step = lambda s, b: rec.step(b)  # noqa: E731
        for b in mlp.batches(cfg, 200):
            step(state, b)
        return state

    bare, watched = train(False), train(True)
    for (n, a), (_, b) in zip(bare.model.state_dict().items(), watched.model.state_dict().items()):
        assert torch.equal(a, b), n
    sa, sb = bare.optimizer.state_dict(), watched.optimizer.state_dict()
    for pid in sa["state"]:
        for key in sa["state"][pid]:
            assert torch.equal(sa["state"][pid][key], sb["state"][pid][key]), (pid, key)
    assert sa["param_groups"] == sb["param_groups"]
    assert bare.scheduler.state_dict() == watched.scheduler.state_dict()


def test_unrecordable_things_are_refused_at_attach_time(projects, tmp_path):
    mlp = projects("rk_mlp")
    state = mlp.build({})
    with pytest.raises(reprokit.CaptureError, match="module level"):
        reprokit.Recorder(state, mlp.train_step, build=lambda c: mlp.build(c), config={}, out_dir=tmp_path)
    with pytest.raises(reprokit.CaptureError, match="config"):
        reprokit.Recorder(state, mlp.train_step, build=mlp.build, config={"fn": print}, out_dir=tmp_path)
    state.extra["logger"] = object()
    with pytest.raises(reprokit.CaptureError, match="extra.*logger"):
        reprokit.Recorder(state, mlp.train_step, build=mlp.build, config={}, out_dir=tmp_path)


@pytest.mark.parametrize("where", ["proc", "under_a_file"])
def test_unwritable_out_dir_warns_and_training_error_is_unchanged(projects, tmp_path, where):
    lm = projects("rk_lm")
    cfg = {"vocab": 20, "max_len": 16}
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    # Both fail even for root: /proc refuses new directories, and a file cannot hold one.
    out = "/proc/reprokit-test" if where == "proc" else blocker / "repros"
    with pytest.warns(reprokit.RecorderWarning, match="cannot write into|could not write a bundle") as said:
        _, exc = record(lm, cfg, lm.batches(cfg, 8, oov_step=6), out, snapshot_every=4)
    # Said when the Recorder was made (not hours later), and again at the failure.
    messages = [str(w.message) for w in said]
    assert "cannot write into" in messages[0] and any("could not write a bundle" in m for m in messages), messages
    assert type(exc) is IndexError and "index out of range" in str(exc)
    assert "reprokit: no bundle could be written" in exc.__notes__


def test_unrecordable_batch_warns_and_training_goes_on(projects, tmp_path):
    mlp = projects("rk_mlp")
    state = mlp.build({})
    rec = reprokit.Recorder(state, mlp.train_step, build=mlp.build, config={}, out_dir=tmp_path, snapshot_every=4)
    batches = list(mlp.batches({}, 12, poison_step=10))
    batches[2]["meta"] = object()  # something no bundle can hold
    with pytest.warns(reprokit.RecorderWarning, match="cannot record step 2"):
        for b in batches[:10]:
            rec.step(b)
    # The window restarted at the snapshot of step 8, so the failure at step 10 is still captured.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(reprokit.TrainingFailure) as info:
            rec.step(batches[10])
    assert open_bundle(info.value.bundle).steps == [8, 9, 10]


def test_restore_hands_owned_optimizer_tensors_over_and_clones_the_rest():
    """``owned`` tensors (copies made for one restore, as replay's GPU preload makes) go to the optimizer as they are;
    every other tensor is cloned, so the snapshot itself survives training after the restore."""
    from reprokit.state import capture_state, restore_state

    def made():
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 4)
        return reprokit.TrainState(model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=0.1))

    state = made()
    state.model(torch.randn(2, 3)).sum().backward()
    state.optimizer.step()
    tree, tensors = capture_state(state)
    snapshot = {k: v.clone() for k, v in tensors.items()}
    owned = {k: v.clone() for k, v in tensors.items() if k.endswith("/exp_avg")}
    assert len(owned) == 2
    fresh = made()
    restore_state(fresh, tree, {**tensors, **owned}, owned=set(owned))
    st = list(fresh.optimizer.state.values())
    assert [s["exp_avg"].data_ptr() for s in st] == [owned[f"optimizer/state/{i}/exp_avg"].data_ptr() for i in (0, 1)]
    for i, s in enumerate(st):
        assert s["exp_avg_sq"].data_ptr() != tensors[f"optimizer/state/{i}/exp_avg_sq"].data_ptr()
        assert torch.equal(s["exp_avg_sq"], tensors[f"optimizer/state/{i}/exp_avg_sq"])
    fresh.model(torch.randn(2, 3)).sum().backward()
    fresh.optimizer.step()
    assert all(torch.equal(tensors[k], snapshot[k]) for k in tensors), "the snapshot is untouched by training"
