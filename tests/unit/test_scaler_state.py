"""A GradScaler's state in a snapshot: on a GPU its scale and growth tracker are taken as the device tensors they live
in (``state_dict()`` would read each with a host-device sync), once a probe scaler has shown, on this torch, that
those reads are what ``state_dict()`` returns; anything else gets ``state_dict()``. The CPU runs every part but the
GPU read itself (tests/integration/test_cuda.py counts the syncs on a GPU)."""

from __future__ import annotations

import torch
from torch import nn

from reprokit import state as st


def _stepped_scaler(**kw) -> torch.amp.GradScaler:
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, **kw)
    for _ in range(3):
        scaler.scale(model(torch.ones(3, 4)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    return scaler


def test_the_probe_confirms_this_torch_s_layout_and_the_reads_equal_state_dict():
    assert st.check_scaler_layout("cpu") is True
    scaler = _stepped_scaler(growth_interval=2)
    reads = st._scaler_reads(scaler, cpu=True)
    assert reads is not None and isinstance(reads["scale"], torch.Tensor)
    assert st._scaler_numbers(reads) == scaler.state_dict() == {
        "scale": 2048.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2, "_growth_tracker": 1}


def test_recorded_tensors_restore_as_numbers_through_load_state_dict():
    scaler = _stepped_scaler(growth_interval=2)
    recorded = st._scaler_reads(scaler, cpu=True)
    fresh = torch.amp.GradScaler("cpu")
    fresh.load_state_dict(st._scaler_numbers(recorded))
    assert fresh.state_dict() == scaler.state_dict()
    assert isinstance(fresh.state_dict()["scale"], float)


def test_a_cpu_scaler_and_a_scaler_that_overrides_a_read_get_their_state_dict():
    assert st.scaler_state(_stepped_scaler()) == _stepped_scaler().state_dict()  # on the CPU a read waits for nothing

    class Custom(torch.amp.GradScaler):
        def get_scale(self) -> float:
            return 5.0

    custom = Custom("cpu")
    assert st.scaler_state(custom) == custom.state_dict() and custom.state_dict()["scale"] == 5.0
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    assert st.scaler_state(disabled) == {}
