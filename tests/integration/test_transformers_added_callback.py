"""``trainer.add_callback(ReprokitCallback(...))``: the callback never sees the Trainer's constructor, so an optimizer
or scheduler given there (``optimizers=``) must be told apart from the Trainer's own at train start (replay makes the
Trainer's own: a deterministic failure would read "NOT REPRODUCED"), without refusing the Trainer's own.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from rk_hf_data import Embeds, tiny
from transformers import Trainer, TrainerCallback, TrainingArguments

from reprokit import TrainingFailure
from reprokit.bundle import open_bundle
from reprokit.cli import main
from reprokit.errors import CaptureError
from reprokit.integrations.transformers import ReprokitCallback

pytestmark = pytest.mark.slow  # importing the Trainer alone takes seconds


def added(tmp_path, dataset, trainer_cls=Trainer, model=None, snapshot_every=4, **kw) -> Trainer:
    """The user's script: a Trainer made first, the callback added to it afterwards."""
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, seed=3, max_steps=6,
                             warmup_steps=2, report_to=[], logging_strategy="no", save_strategy="no",
                             disable_tqdm=True, use_cpu=True)
    t = trainer_cls(model=model or tiny(), args=args, train_dataset=dataset, **kw)
    t.add_callback(ReprokitCallback(out_dir=tmp_path / "repros", snapshot_every=snapshot_every))
    return t


def as_the_trainer_makes(model: torch.nn.Module, args: TrainingArguments, **override) -> torch.optim.Optimizer:
    """The optimizer ``Trainer.create_optimizer`` makes (decayed parameters, then the others), with ``override``."""
    opt_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    decay = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]  # uses no self
    named = list(model.named_parameters())
    return opt_cls([{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                    {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}],
                   **{**kwargs, **override})


def refused(tmp_path, t: Trainer, match: str) -> None:
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    with pytest.raises(CaptureError, match=match) as info:
        t.train()
    assert "add_callback" in str(info.value) and "Trainer(callbacks=[" in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in t.model.state_dict().items()), "no step ran"
    assert not (tmp_path / "repros").exists() or not any((tmp_path / "repros").iterdir())


def replayed(bundle) -> dict:
    out = CliRunner().invoke(main, ["replay", str(bundle), "--json"])
    assert out.exit_code == 1, out.output
    return json.loads(out.output)


@pytest.mark.parametrize("given", ["one_group", "other_eps", "scheduler"])
def test_an_added_callback_refuses_an_optimizer_or_scheduler_the_trainer_would_not_make(tmp_path, given):
    """What the constructor was given leaves no mark: the optimizer is compared with the Trainer's own (class,
    parameter groups, every hyperparameter) and the scheduler must be the one ``create_scheduler`` made."""
    model = tiny()
    probe = TrainingArguments(output_dir=str(tmp_path / "probe"), use_cpu=True, report_to=[])
    if given == "one_group":  # the Trainer's class and LR, but one group: weight decay on biases and LayerNorms too
        opt_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(probe, model)
        optimizers = (opt_cls(model.parameters(), **kwargs), None)
        match = "1 parameter group, where the Trainer makes 2"
    elif given == "other_eps":
        optimizers = (as_the_trainer_makes(model, probe, eps=1e-3), None)
        match = "eps=0.001"
    else:  # the Trainer's very optimizer, with a constant schedule of the user's in place of linear warmup
        opt = as_the_trainer_makes(model, probe)
        optimizers = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
        match = "LambdaLR.*not made by Trainer.create_scheduler"
    refused(tmp_path, added(tmp_path, Embeds(8), model=model, optimizers=optimizers), match)


def test_an_added_callback_records_a_default_trainer_and_refuses_it_with_an_sgd_given(tmp_path):
    """The Trainer's own AdamW and warmup schedule: recorded, and the NaN update replays bit-exact. The same Trainer
    given an SGD trains with it, replay with AdamW: refused before the first step."""
    with pytest.raises(TrainingFailure) as info:
        added(tmp_path, Embeds(16, bad=5)).train()
    d = replayed(info.value.bundle)
    assert d["verdict"] == "deterministic" and d["failure"]["kind"] == "nonfinite_loss"
    assert d["fidelity"]["bit_exact"] and d["fidelity"]["steps_compared"] >= 1, d["fidelity"]

    model = tiny()
    t = added(tmp_path / "sgd", Embeds(16, bad=5), model=model,
              optimizers=(torch.optim.SGD(model.parameters(), lr=5e-5), None))
    refused(tmp_path / "sgd", t, "optimizer is a torch.optim.sgd.SGD, where the Trainer makes a torch.optim")


def test_an_added_callback_accepts_a_subclass_that_makes_its_own_optimizer(tmp_path, projects):
    """SGD from a Trainer subclass (``create_optimizer``) travels in the code snapshot: replay makes it again, so the
    NaN update replays bit-exact (with AdamW the losses after the first update would differ). The same SGD handed to
    a plain Trainer is refused."""
    own = projects("rk_hf_model")
    with pytest.raises(TrainingFailure) as info:
        added(tmp_path, Embeds(16, bad=5), trainer_cls=own.SGDTrainer).train()
    run = json.loads((info.value.bundle / "run.json").read_text())
    assert run["config"]["trainer"]["class"] == {"module": "rk_hf_model", "qualname": "SGDTrainer"}
    d = replayed(info.value.bundle)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"] and d["fidelity"]["steps_compared"] >= 1

    model = tiny()
    t = added(tmp_path / "given", Embeds(16, bad=5), model=model,
              optimizers=(torch.optim.SGD(model.parameters(), lr=5e-5, momentum=0.9), None))
    refused(tmp_path / "given", t, "optimizer is a torch.optim.sgd.SGD")


class CutTheLR(TrainerCallback):
    """Scales each tensor LR by 0.1 in place after update ``after`` (between two updates, as a callback might)."""

    def __init__(self, after: int):
        self.after = after

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        if state.global_step == self.after + 1:
            for group in optimizer.param_groups:
                group["lr"].mul_(0.1)


def test_a_tensor_lr_changed_in_place_between_updates_starts_a_window(tmp_path, projects):
    """The LRs after an update are kept as device copies of the tensors (no sync) and compared at the next update's
    start: the in-place cut after update 1 starts a window at update 2, whose snapshot holds the cut LR. A window
    from update 0 would replay update 2 at the scheduler's LR, and the NaN update 3 would not replay bit-exact."""
    own = projects("rk_hf_model")
    # Row 3 is in update 3 (seed 3); snapshots every 8 updates: one window, unless the cut starts another.
    t = added(tmp_path, Embeds(16, bad=3), trainer_cls=own.TensorLRTrainer, snapshot_every=8)
    t.add_callback(CutTheLR(after=1))  # after ReprokitCallback's on_step_end, which copied the LRs
    with pytest.raises(TrainingFailure) as info:
        t.train()
    assert isinstance(t.optimizer.param_groups[0]["lr"], torch.Tensor)
    b = open_bundle(info.value.bundle)
    assert (b.failure.step, b.run["window"]["steps"]) == (3, [2, 3])
    d = replayed(b.path)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"], d["fidelity"]


class _Plain(torch.nn.Module):
    """A model the Trainer takes (any torch.nn.Module returning a loss) with no transformers config."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.mse_loss(self.lin(x).squeeze(-1), labels)}


def test_a_plain_module_without_a_transformers_config_is_refused_at_train_start_with_what_to_do(tmp_path):
    # It was a bare AttributeError ('_Plain' object has no attribute 'config') from inside on_train_begin.
    rows = [{"x": torch.randn(4), "labels": torch.randn(())} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=2,
                             report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True, use_cpu=True)
    t = Trainer(model=_Plain(), args=args, train_dataset=rows,
                callbacks=[ReprokitCallback(out_dir=tmp_path / "repros")])
    with pytest.raises(CaptureError, match="has no transformers config .* record this run with reprokit.Recorder"):
        t.train()
