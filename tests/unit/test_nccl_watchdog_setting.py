"""When NCCL's watchdog ends a process on a CUDA error before reprokit can write its bundle: the setting that decides
it (``TORCH_NCCL_RETHROW_CUDA_ERRORS``) and the backends it concerns."""

from __future__ import annotations

import pytest

from reprokit.distributed import nccl_aborts_on_device_errors

VAR = "TORCH_NCCL_RETHROW_CUDA_ERRORS"


@pytest.mark.parametrize("value", [None, "1", "true", "TRUE", "y", "yes"])
def test_nccl_aborts_unless_the_setting_is_off(value):
    env = {} if value is None else {VAR: value}
    assert nccl_aborts_on_device_errors("nccl", env)
    assert nccl_aborts_on_device_errors("cpu:gloo,cuda:nccl", env)  # a group made with both backends


@pytest.mark.parametrize("value", ["0", "false", "False", "n", "NO"])
def test_the_setting_off_keeps_the_process_alive(value):
    assert not nccl_aborts_on_device_errors("nccl", {VAR: value})


@pytest.mark.parametrize("backend", ["gloo", "mpi", "cpu:gloo"])
def test_other_backends_have_no_such_watchdog(backend):
    assert not nccl_aborts_on_device_errors(backend, {})


def test_the_process_environment_is_read_by_default(monkeypatch):
    monkeypatch.setenv(VAR, "0")
    assert not nccl_aborts_on_device_errors("nccl")
    monkeypatch.delenv(VAR)
    assert nccl_aborts_on_device_errors("nccl")
