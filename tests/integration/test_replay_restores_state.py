"""Adversarial replay checks: every replay of a bundle must start from the state the recording had at the snapshot,
however the last replay (or the recorded run) left the live objects. A state that leaks from one replay into the
next turns a deterministic failure into a "flaky" one; a state left out of the snapshot makes the replay run other
numbers than the recording did."""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rk_testing import bundle_of, record

import reprokit
from reprokit.replayer import session


@pytest.fixture
def project(tmp_path, monkeypatch):
    """Write a user module into its own folder and import it (a fresh module name per test)."""
    made: list[str] = []

    def make(name: str, source: str) -> Any:
        folder = tmp_path / f"src_{name}"
        folder.mkdir()
        (folder / f"{name}.py").write_text(textwrap.dedent(source))
        monkeypatch.syspath_prepend(str(folder))
        made.append(name)
        return importlib.import_module(name)

    yield make
    for name in made:
        sys.modules.pop(name, None)


def batches(n: int, dim: int = 4, rows: int = 6) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(rows, dim, generator=g) * 3 + 1, "i": torch.tensor(i)} for i in range(n)]


def record_bundle(mod: Any, config: dict, n: int, out: Path, snapshot_every: int = 3) -> Path:
    _, exc = record(mod, config, batches(n), out, snapshot_every=snapshot_every)
    return bundle_of(exc)


SCALER = """
import torch
from torch import nn
import reprokit

def build(config):
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    return reprokit.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                               scaler=torch.amp.GradScaler("cpu", init_scale=2.0**4))

def train_step(state, batch):
    loss = (state.model(batch["x"]) ** 2).mean()
    state.scaler.scale(loss).backward()
    state.scaler.unscale_(state.optimizer)
    if int(batch["i"]) == 4:
        raise ValueError("the step's own check fails between unscale_ and update")
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    return loss
"""


@pytest.mark.slow
def test_a_step_that_raises_after_unscale_is_deterministic_over_times(project, tmp_path):
    # The GradScaler notes "unscale_ was called" until update(); a replay that raised before update() left that note,
    # and load_state_dict keeps it: the next replay's unscale_ raised "already been called" (verdict: flaky).
    mod = project("restored_scaler", SCALER)
    bundle = record_bundle(mod, {}, 8, tmp_path / "repros")
    report = reprokit.replay(bundle, times=3)
    assert [r.verdict for r in report.runs] == ["reproduced"] * 3, [r.failure and r.failure.message for r in report.runs]
    assert report.verdict == "deterministic" and report.fidelity["runs_bit_identical"]


MODES = """
import torch
from torch import nn
import reprokit

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3))
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.backbone(x)))

def build(config):
    torch.manual_seed(0)
    m = Net()
    m.train()
    if config["mode"] == "eval_backbone":
        m.backbone.eval()  # fine-tuning: the backbone's BatchNorm keeps its statistics, no dropout
    else:
        m.backbone.requires_grad_(False)  # frozen at first: train_step unfreezes it at its third step
    return reprokit.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.05), extra={"n": 0})

def train_step(state, batch):
    state.extra["n"] += 1
    if state.extra["n"] == 3:
        state.model.backbone.requires_grad_(True)
    loss = ((state.model(batch["x"]) - 1) ** 2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss * float("nan") if int(batch["i"]) == 7 else loss
"""


@pytest.mark.parametrize("mode", ["eval_backbone", "unfrozen_mid_run"])
@pytest.mark.slow
def test_submodule_modes_and_requires_grad_are_restored(project, tmp_path, mode):
    # Neither is in a state_dict: restore called model.train(), which put the eval backbone back into train mode,
    # and left the backbone frozen as build() makes it although the run had unfrozen it before the snapshot.
    mod = project(f"restored_modes_{mode}", MODES)
    bundle = record_bundle(mod, {"mode": mode}, 10, tmp_path / "repros", snapshot_every=4)
    report = reprokit.replay(bundle, times=2)
    assert report.verdict == "deterministic"
    assert report.fidelity["steps_compared"] == 4 and report.fidelity["bit_exact"], report.fidelity["first_diverging"]
    with session(bundle) as s:
        s.run(s.inputs())
        s.state.model.train()  # whatever the last run left
        s.state.model.backbone.requires_grad_(mode == "eval_backbone")
        s.restore()
        m = s.state.model
        assert m.training and m.head.training
        assert [x.training for x in m.backbone.modules()] == [mode != "eval_backbone"] * 4
        assert all(p.requires_grad for p in m.parameters())


COUNTER = """
import torch
from torch import nn
import reprokit

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.register_buffer("calls", torch.zeros(()), persistent=False)  # in no state_dict

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * (1 + 0.1 * self.calls)

def build(config):
    torch.manual_seed(0)
    m = Net()
    return reprokit.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.01))

def train_step(state, batch):
    loss = ((state.model(batch["x"]) - 1) ** 2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss * float("nan") if int(batch["i"]) == 7 else loss
"""


@pytest.mark.slow
def test_non_persistent_buffers_start_every_replay_alike(project, tmp_path):
    # load_state_dict leaves non-persistent buffers alone: each replay started from the counter the last one left,
    # so --times N runs differed from each other, and a shrink candidate restored from a mid-window snapshot
    # (Session.advance) ran with whatever the last candidate left.
    mod = project("restored_counter", COUNTER)
    bundle = record_bundle(mod, {}, 10, tmp_path / "repros", snapshot_every=4)
    report = reprokit.replay(bundle, times=3)
    assert report.verdict == "deterministic"
    assert report.fidelity["runs_bit_identical"], [r.losses for r in report.runs]
    assert repr(report.runs[0].losses) == repr(report.runs[2].losses)  # NaN at the failing step
    assert "non-persistent buffer" in report.fidelity["hint"]  # the recording's counter was 4 steps further
    with session(bundle) as s:
        inputs = s.inputs()
        snap = s.advance(inputs[:2])
        assert snap is not None
        first, second = s.run(inputs[2:], snap), s.run(inputs[2:], snap)
        assert repr(first.losses) == repr(second.losses) and first.same and second.same
        assert float(s.state.model.calls) == 4


CAST_IN_STEP = COUNTER.replace("persistent=False", "persistent=True").replace(
    "def train_step(state, batch):\n", "def train_step(state, batch):\n    state.model.double()\n")


@pytest.mark.parametrize("where", ["loop", "step"])
@pytest.mark.slow
def test_a_model_in_another_dtype_than_build_makes_replays_in_the_recorded_dtype(project, tmp_path, where):
    # load_state_dict casts into the live dtype: a model the loop cast to float64 after build() replayed in float32,
    # with the optimizer's state cast along. (A step that casts the model itself was exact, and stays so.)
    mod = project(f"restored_cast_{where}", CAST_IN_STEP if where == "step" else COUNTER.replace("persistent=False",
                                                                                             "persistent=True"))
    state = mod.build({})
    if where == "loop":
        state.model.double()
    rec = reprokit.Recorder(state, mod.train_step, build=mod.build, config={}, out_dir=tmp_path / "repros",
                            snapshot_every=4)
    with pytest.raises(reprokit.TrainingFailure) as info:
        for b in batches(10):
            rec.step({"x": b["x"].double(), "i": b["i"]})
    report = reprokit.replay(info.value.bundle, times=2)
    assert report.verdict == "deterministic" and report.fidelity["runs_bit_identical"]
    assert report.fidelity["bit_exact"] and report.fidelity["steps_compared"] == 4, report.fidelity["first_diverging"]
    with session(info.value.bundle) as s:
        weight = s.state.model.lin.weight
        s.restore()
        assert s.state.model.lin.weight is weight and weight.dtype == torch.float64
        assert s.state.model.calls.dtype == torch.float64
        assert s.state.optimizer.param_groups[0]["params"][0] is weight


GROUPS = """
import torch
from torch import nn
import reprokit

def build(config):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    m[0].requires_grad_(False)
    return reprokit.TrainState(model=m, optimizer=torch.optim.Adam(m[1].parameters(), lr=0.01), extra={"n": 0})

def train_step(state, batch):
    state.extra["n"] += 1
    if state.extra["n"] == 2:  # unfreeze the first layer into a group of its own
        state.model[0].requires_grad_(True)
        state.optimizer.add_param_group({"params": list(state.model[0].parameters()), "lr": 1e-3})
    loss = ((state.model(batch["x"]) - 1) ** 2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss * float("nan") if int(batch["i"]) == 7 else loss
"""


def test_a_param_group_added_during_the_run_is_refused_with_what_to_do(project, tmp_path):
    mod = project("restored_groups", GROUPS)
    bundle = record_bundle(mod, {}, 10, tmp_path / "repros", snapshot_every=4)
    with pytest.raises(reprokit.StateMismatchError, match=r"recorded \[2, 2\], build\(\) made \[2\]\).*add_param_group"
                                                          r".*create every group in build\(\)"):
        reprokit.replay(bundle)


TEMPERATURE = """
import numpy as np
import torch
from torch import nn
import reprokit

def build(config):
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    log_t = torch.zeros((), requires_grad=True)  # a learnable temperature: in extra and in the optimizer
    opt = torch.optim.SGD([*m.parameters(), log_t], lr=0.1)
    return reprokit.TrainState(model=m, optimizer=opt, extra={"log_t": log_t, "seen": [torch.zeros(2)],
                                                                                 "hist": np.zeros(2)})

def train_step(state, batch):
    state.extra["seen"][0] += batch["x"][0, :2]
    state.extra["hist"] += batch["x"][0, :2].numpy()
    loss = ((state.model(batch["x"]) * state.extra["log_t"].exp() - 1) ** 2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss * float("nan") if int(batch["i"]) == 7 else loss
"""


@pytest.mark.slow
def test_a_tensor_in_extra_that_the_optimizer_trains_is_restored_in_place(project, tmp_path):
    # restore replaced every tensor of extra by a new one (not requiring grad): the step's temperature was no longer
    # the one the optimizer steps, and the replay diverged one step after the snapshot.
    mod = project("restored_temperature", TEMPERATURE)
    bundle = record_bundle(mod, {}, 10, tmp_path / "repros", snapshot_every=4)
    report = reprokit.replay(bundle, times=2)
    assert report.fidelity["bit_exact"] and report.fidelity["steps_compared"] == 4, report.fidelity["first_diverging"]
    with session(bundle) as s:
        log_t, seen, hist = s.state.extra["log_t"], s.state.extra["seen"], s.state.extra["hist"]
        s.run(s.inputs())
        s.restore()
        assert s.state.extra["log_t"] is log_t and log_t.requires_grad
        assert s.state.optimizer.param_groups[0]["params"][-1] is log_t
        assert s.state.extra["seen"] is seen and s.state.extra["hist"] is hist
        assert torch.allclose(seen[0], torch.from_numpy(hist).float()), "both summed the same rows since the start"
        assert float(log_t.detach()) != 0.0, "the recorded value, not build()'s"


NUMPY_BATCH = """
import torch
from torch import nn
import reprokit

def build(config):
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    return reprokit.TrainState(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))

def train_step(state, batch):
    w = torch.from_numpy(batch["w"])
    loss = (((state.model(batch["x"]) - 1) ** 2).squeeze(-1) * w).mean()
    batch["w"] *= 2  # scribbles on its numpy input after using it
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss * float("nan") if int(batch["i"]) == 7 else loss
"""


@pytest.mark.slow
def test_a_step_that_edits_a_numpy_array_of_its_batch_does_not_change_the_next_replay(project, tmp_path):
    # Each run copied the batch's tensors but handed over its numpy arrays as decoded: views of the stored batch, so
    # the second of --times 2 ran on the weights the first had doubled.
    mod = project("restored_numpy_batch", NUMPY_BATCH)
    batches_np = [{**b, "w": np.ones(6, dtype=np.float32)} for b in batches(10)]
    _, exc = record(mod, {}, batches_np, tmp_path / "repros", snapshot_every=4)
    report = reprokit.replay(bundle_of(exc), times=2)
    assert report.verdict == "deterministic" and report.fidelity["bit_exact"]
    assert report.fidelity["runs_bit_identical"], [r.losses for r in report.runs]


RAISES_AFTER_BACKWARD = TEMPERATURE.replace(
    "    loss.backward()\n    state.optimizer.step()",
    "    loss.backward()\n    if int(batch['i']) == 7:\n        raise RuntimeError('a check after backward fails')\n"
    "    state.optimizer.step()")


@pytest.mark.slow
def test_a_gradient_left_on_an_optimizer_parameter_outside_the_model_does_not_leak_into_the_next_replay(project,
                                                                                                        tmp_path):
    # The failing replay raised after its backward: the temperature (in the optimizer, not in the model) kept that
    # gradient, restore reset only the model's, and the next replay's first backward added to it (runs differed).
    mod = project("restored_outside_grad", RAISES_AFTER_BACKWARD)
    bundle = record_bundle(mod, {}, 10, tmp_path / "repros", snapshot_every=4)
    report = reprokit.replay(bundle, times=2)
    assert report.verdict == "deterministic" and report.fidelity["bit_exact"]
    assert report.fidelity["runs_bit_identical"], [r.losses for r in report.runs]
    with session(bundle) as s:
        s.run(s.inputs())
        assert s.state.extra["log_t"].grad is not None
        s.restore()
        assert s.state.extra["log_t"].grad is None, "none at the snapshot (zero_grad(set_to_none=True))"


MASTER = """
import torch
from torch import nn
import reprokit

class Float64Momentum(torch.optim.Optimizer):
    # Momentum kept in float64 for float32 parameters (a higher-precision buffer, as mixed-precision optimizers keep).
    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p, dtype=torch.float64))
                    buf.mul_(0.9).add_(p.grad.double() / 3)
                    p.sub_((g["lr"] * buf).float())

def build(config):
    torch.manual_seed(0)
    m = nn.Linear(4, 1)
    return reprokit.TrainState(model=m, optimizer=Float64Momentum(m.parameters(), lr=0.05))

def train_step(state, batch):
    loss = ((state.model(batch["x"]) - 1) ** 2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss * float("nan") if int(batch["i"]) == 7 else loss
"""


def test_optimizer_state_comes_back_in_the_dtype_it_was_recorded_in(project, tmp_path):
    # Optimizer.load_state_dict casts floating-point state to the parameter's dtype: the float64 momentum came back
    # rounded to float32, and the replay stepped from other numbers than the recording.
    mod = project("restored_master", MASTER)
    bundle = record_bundle(mod, {}, 10, tmp_path / "repros", snapshot_every=4)
    with session(bundle) as s:
        tree, tensors = s.snapshot
        s.restore()
        for i, p in enumerate(s.state.model.parameters()):
            recorded = tensors[f"optimizer/state/{i}/buf"]
            live = s.state.optimizer.state[p]["buf"]
            assert live.dtype == torch.float64 and torch.equal(live, recorded)
            assert live.data_ptr() != recorded.data_ptr(), "the snapshot stays the snapshot"


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two decoded state trees differ (tensors by dtype, shape and bits; NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.cpu().view(-1).view(torch.uint8), b.cpu().contiguous().view(-1).view(torch.uint8))
        return [] if same else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b)) if isinstance(b, dict) else b!r}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [f"{path}: {a!r} vs {b!r}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}/{i}")]
    return [] if a == b or (a != a and b != b) else [f"{path}: {a!r} vs {b!r}"]


@pytest.mark.slow
def test_every_restore_gives_back_exactly_the_recorded_snapshot(projects, tmp_path):
    # Regression guard for the "exact" claim over repeats: after a run, a restore captures as the bundle's snapshot
    # (model, optimizer with its step counters and param_groups, scheduler, scaler, gradients, modes, RNG).
    mlp = projects("rk_mlp")
    cfg = {"optimizer": "adam", "scheduler": "sequential", "scaler": True}
    _, exc = record(mlp, cfg, mlp.batches(cfg, 14, poison_step=11), tmp_path, snapshot_every=5)
    from reprokit import pytree

    with session(bundle_of(exc)) as s:
        tree, tensors = s.snapshot
        recorded = pytree.decode(tree["state"], tensors)
        for _ in range(2):
            assert s.run(s.inputs()).same
            s.restore()
            live_tree, live_tensors = s.capture()
            assert _differences(recorded, pytree.decode(live_tree["state"], live_tensors)) == []
            assert _differences(tree["rng"], live_tree["rng"]) == []
            assert _differences({k: v for k, v in tensors.items() if k.startswith("rng/")},
                                {k: v for k, v in live_tensors.items() if k.startswith("rng/")}) == []
            assert live_tree["monitor"] == tree["monitor"]
