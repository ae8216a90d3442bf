"""A run on cuda:0 that writes a bundle creates no CUDA context on the machine's other GPUs (a context costs about
500 MiB of a GPU's memory, exactly when memory is tightest; under torchrun every failing rank would make one on
every GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA devices (run on a GPU machine with two)")]

TESTS = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent("""
    import os, sys
    sys.path[:0] = [sys.argv[2], sys.argv[3]]
    import reprokit, rk_gpu
    from rk_testing import record
    rec, exc = record(rk_gpu, {"device": "cuda:0"}, rk_gpu.batches(20, 15, "cuda:0"), sys.argv[1], snapshot_every=10)
    assert isinstance(exc, reprokit.TrainingFailure) and exc.bundle is not None, exc
    print("bundle written", flush=True)
    sys.stdin.readline()  # keep the process (and its contexts) alive while the parent looks
""")


def _smi(query: str, what: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-{query}={what}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]


def _used_mib() -> dict[str, int]:
    return {uuid: int(used) for _, uuid, used in _smi("gpu", "index,uuid,memory.used")}


def test_writing_a_bundle_on_cuda0_makes_no_context_on_cuda1(tmp_path):
    uuids = [uuid for _, uuid, _ in sorted(_smi("gpu", "index,uuid,memory.used"), key=lambda r: int(r[0]))]
    before = _used_mib()
    env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # CUDA's device 0 and 1 are nvidia-smi's 0 and 1
    env.pop("CUDA_VISIBLE_DEVICES", None)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(TESTS), str(TESTS / "projects")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout.readline().strip() == "bundle written"
        apps = _smi("compute-apps", "pid,gpu_uuid,used_memory")
        after = _used_mib()
    finally:
        child.communicate("\n", timeout=60)
    assert child.returncode == 0
    mine = {uuid for pid, uuid, _ in apps if pid == str(child.pid)}
    if mine:  # nvidia-smi sees this process's pids
        assert mine == {uuids[0]}, f"the run on cuda:0 has contexts on {sorted(mine)}, GPUs {uuids}"
    else:  # another pid namespace (a container): judge by each GPU's memory in use
        grew = {uuid: after[uuid] - before[uuid] for uuid in uuids}
        assert grew[uuids[0]] >= 200, f"the child's context on cuda:0 is not visible ({grew}): the check sees nothing"
        assert all(grew[u] < 200 for u in uuids[1:]), f"MiB in use grew on other GPUs: {grew}"
