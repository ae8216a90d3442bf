"""build() returning the TrainState of another copy of reprokit (a checkout that carries its own) is taken over."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import reprokit
from reprokit.replayer import as_train_state

STATE_PY = Path(reprokit.__file__).parent / "state.py"


def _other_copy():
    """reprokit/state.py loaded a second time under another name: its TrainState is another class."""
    spec = importlib.util.spec_from_file_location("vendored_reprokit_state", STATE_PY)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    assert module.TrainState is not reprokit.TrainState
    return module


def test_a_train_state_from_another_copy_of_reprokit_is_taken_over_field_by_field():
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    foreign = _other_copy().TrainState(model=model, optimizer=opt, extra={"k": 1})
    assert not isinstance(foreign, reprokit.TrainState)
    state = as_train_state(foreign)
    assert isinstance(state, reprokit.TrainState)
    assert state.model is model and state.optimizer is opt and state.extra == {"k": 1}


def test_anything_else_is_refused_naming_what_it_was():
    with pytest.raises(reprokit.CodeLoadError, match=r"got builtins\.dict"):
        as_train_state({"model": None})
