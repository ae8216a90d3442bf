"""The ``on_incident`` option: validated at attach time, naming the option and the values it takes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import reprokit
from reprokit.distributed.abort import abort_interrupts, check_on_incident


def build(config):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def train_step(state, batch):
    loss = state.model(batch).pow(2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("value", ["kill", "Abort", None, True, ""])
def test_an_unknown_on_incident_is_refused_naming_the_option_and_its_values(tmp_path, value):
    state = build({})
    with pytest.raises(reprokit.ConfigError, match=r"on_incident must be \"abort\" or \"wait\"") as e:
        reprokit.Recorder(state, train_step, build=build, config={}, out_dir=tmp_path, on_incident=value)
    assert repr(value) in str(e.value)
    assert "--on-incident" in e.value.cli_message
    # refused before anything was attached: the optimizer steps without hooks of reprokit's
    assert not state.optimizer._optimizer_step_pre_hooks and not state.optimizer._optimizer_step_post_hooks


@pytest.mark.parametrize("value", ["abort", "wait"])
def test_both_values_record_a_single_process_run_as_before(tmp_path, value):
    state = build({})
    rec = reprokit.Recorder(state, train_step, build=build, config={}, out_dir=tmp_path, on_incident=value)
    try:
        assert rec.on_incident == value
        losses = [float(rec.step(torch.ones(2, 4))) for _ in range(3)]
        assert losses[0] > losses[-1]
    finally:
        rec.close()


def test_the_default_is_abort():
    import inspect

    assert inspect.signature(reprokit.Recorder).parameters["on_incident"].default == "abort"
    assert check_on_incident("wait") == "wait"


def test_an_abort_interrupts_every_backend_but_gloo_alone():
    assert abort_interrupts("nccl") and abort_interrupts("cpu:gloo,cuda:nccl")
    assert not abort_interrupts("gloo") and not abort_interrupts("cpu:gloo")
