"""torchrun --max-restarts (gloo, CPU): a rank fails, torchrun restarts every worker, and the next attempt creates its
Recorders again. ``python rk_elastic_restart.py OUT_DIR SCENARIO``; the attempt is ``TORCHELASTIC_RESTART_COUNT``."""

from __future__ import annotations

import datetime
import gc
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import reprokit


def build(config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if dist.is_available() and dist.is_initialized():
        model = DistributedDataParallel(model)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))


def train_step(state, batch):
    if bool(batch["boom"]):  # before backward: the other rank waits in this step's all-reduce
        raise IndexError("index 99 is out of bounds on this rank")
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


# scenario: {attempt: {rank: step at which that rank raises}}
SCENARIOS = {
    "recovers": {0: {1: 3}},  # attempt 0: rank 1 raises at step 3; attempt 1 trains to the end
    "fails-twice": {0: {1: 3}, 1: {0: 5}},  # attempt 1 fails too, on rank 0 at step 5
}
STEPS = 8


def init_process_group(attempt: int) -> None:
    """gloo on torchrun's own store, under a prefix per attempt. torchrun keeps one store for every attempt (the
    static rendezvous, and the c10d one that shares its store), and gloo's rendezvous keys carry no attempt: without
    the prefix a restarted rank now and then reads the address its dead predecessor left and gloo's connectFullMesh
    fails (about one restart in two here; pytorch/pytorch#135712 is the same for NCCL)."""
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt{attempt}/", store), timeout=timeout,
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def main(out_dir: str, scenario: str) -> None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    init_process_group(attempt)
    rank = dist.get_rank()
    state = build({})
    rec = reprokit.Recorder(state, train_step, build=build, config={}, out_dir=out_dir, snapshot_every=2,
                            incident_wait_s=20)
    boom_at = SCENARIOS[scenario].get(attempt, {}).get(rank)
    g = torch.Generator().manual_seed(rank)
    try:
        for step in range(STEPS):
            x = torch.randn(8, 8, generator=g)
            rec.step({"x": x, "y": x.sum(1), "boom": torch.tensor(step == boom_at)})
    except Exception as e:
        print(f"attempt {attempt} rank {rank}: {type(e).__name__} at step {rec.step_index}", flush=True)
        raise
    # An attempt that took an earlier attempt's incident file for one of its own would write a peer bundle for it
    # from its watcher thread (a poll, then a grace of a second): give it time to, before saying what it wrote.
    time.sleep(3)
    print(f"attempt {attempt} rank {rank}: done, bundles {[str(b) for b in rec.bundles]}", flush=True)
    # Torn down while the interpreter is alive (see rk_dist_incidents.py): the DDP model holds the process group.
    rec.close()
    del rec, state
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
