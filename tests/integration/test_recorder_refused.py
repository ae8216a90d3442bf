"""A Recorder whose constructor raises leaves nothing attached to the user's optimizer."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

import reprokit

REPROKIT = str(Path(reprokit.__file__).parent)


def _hooks(opt: torch.optim.Optimizer) -> tuple[list, list]:
    return list(opt._optimizer_step_pre_hooks.values()), list(opt._optimizer_step_post_hooks.values())


def _reprokit_frames_in_step(opt: torch.optim.Optimizer) -> list[str]:
    """The functions of reprokit that run during ``opt.step()`` (observed with a profiler, not by inspecting hooks)."""
    seen: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(REPROKIT):
            seen.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return seen


def _abandoned_leftover(out: Path) -> None:
    """A temp folder of a killed writer, old enough to be removable: the Recorder warns about it at attach."""
    tmp = out / ".tmp-bundle-20260101-000000-step00000007-nonfinite_loss-0123abcd"
    tmp.mkdir(parents=True)
    (tmp / "run.json").write_text("{}")
    old = 1_000_000_000
    for p in (tmp / "run.json", tmp):
        os.utime(p, (old, old))


def test_recorder_refused_after_its_hooks_leaves_the_optimizer_as_it_was(tmp_path, projects):
    mlp = projects("rk_mlp")
    state = mlp.build({})
    opt = state.optimizer
    for p in state.model.parameters():
        p.grad = torch.zeros_like(p)
    before = _hooks(opt)
    assert not _reprokit_frames_in_step(opt)
    _abandoned_leftover(tmp_path / "repros")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the leftover warning, raised at attach once the hooks are registered
        with pytest.raises(reprokit.RecorderWarning, match="unfinished bundle folder"):
            reprokit.Recorder(state, mlp.train_step, build=mlp.build, config={}, out_dir=tmp_path / "repros")
    assert _hooks(opt) == before
    assert not _reprokit_frames_in_step(opt), "a refused Recorder still runs on optimizer.step()"


def test_recorder_refused_on_an_option_leaves_the_optimizer_as_it_was(tmp_path, projects):
    mlp = projects("rk_mlp")
    state = mlp.build({})
    before = _hooks(state.optimizer)
    with pytest.raises(reprokit.ReprokitError, match="replicated_state"):
        reprokit.Recorder(state, mlp.train_step, build=mlp.build, config={}, out_dir=tmp_path,
                          replicated_state="sometimes")
    assert _hooks(state.optimizer) == before
