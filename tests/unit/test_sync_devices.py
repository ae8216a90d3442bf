"""A bundle write waits only on the CUDA devices the recorder used (synchronising any other would create a CUDA
context there); which ones is a pure function of the devices it saw."""

from __future__ import annotations

import torch

import reprokit
from reprokit.record import cuda_devices


def test_only_cuda_devices_each_once_with_the_current_one_for_a_bare_cuda():
    cuda = torch.device
    seen = [cuda("cpu"), cuda("cuda", 2), cuda("cuda", 0), cuda("cuda", 2), cuda("meta"), cuda("cuda")]
    assert cuda_devices(seen, current=3) == [0, 2, 3]
    assert cuda_devices(seen[:2], current=0) == [2], "a process on cuda:2 waits on cuda:2 only, not on cuda:0"
    assert cuda_devices([cuda("cpu")], current=0) == []
    assert cuda_devices([], current=0) == []


def test_a_cpu_run_uses_no_cuda_device(tmp_path, projects):
    mlp = projects("rk_mlp")
    state = mlp.build({})
    rec = reprokit.Recorder(state, mlp.train_step, build=mlp.build, config={}, out_dir=tmp_path)
    try:
        for batch in mlp.batches({}, 3, poison_step=None):
            rec.step(batch)
        assert cuda_devices(rec._devices(), current=0) == []
    finally:
        rec.close()
