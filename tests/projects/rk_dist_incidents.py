"""torchrun (gloo, CPU) scenarios for the multi-rank recorder: recovery after an incident, ranks failing at
different steps, a folder per rank. ``python rk_dist_incidents.py OUT_DIR SCENARIO``."""

from __future__ import annotations

import datetime
import gc
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import reprokit

CRASH_ENV = "RK_DIST_INCIDENTS_CRASH"
"""Set (to anything) in a process's environment, its failing step kills the process instead of raising: what a replay's
ranks are given to die in the failing step (a segfault, an OOM kill), the recording run never."""


def build(config):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    if config.get("big"):  # a 1 MiB tensor: its bundle file is hashed on a helper thread, as a real model's is
        model.register_buffer("table", torch.zeros(1 << 18))
    if dist.is_available() and dist.is_initialized():
        model = DistributedDataParallel(model)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05))


def train_step(state, batch):
    if bool(batch["boom"]) and os.environ.get(CRASH_ENV):
        os._exit(7)  # the process dies in the failing step (as in a segfault or an OOM kill)
    if bool(batch["boom"]):
        raise IndexError("index 99 is out of bounds on this rank")
    loss = nn.functional.mse_loss(state.model(batch["x"]).squeeze(-1), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    if "late" in batch and bool(batch["late"]):  # after the all-reduce: the other rank finishes its step
        raise IndexError("index 99 is out of bounds on this rank, after the update")
    return loss


# scenario: {rank: {step: "nan" | "raise"}}; a failure is caught and training goes on ("recover")
SCENARIOS = {
    "recover-replicated": {1: {3: "nan", 9: "nan"}},  # rank 1's bundles reference rank 0's state
    "rank0-only": {0: {3: "nan"}},  # only rank 0 creates a Recorder
    "raise-late": {1: {7: "raise"}},  # with snapshot_every=4: a window of steps 4..7 before rank 1 raises
    "exit-unclosed": {1: {11: "late"}},  # rank 1 fails in the last step; rank 0 ends without closing its Recorder
}


def main(out_dir: str, scenario: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    config: dict = {}
    if scenario == "exit-unclosed":
        config["big"] = True  # written at interpreter exit, where no new thread helps
    state = build(config)
    if scenario == "split":
        out_dir = os.path.join(out_dir, f"rank{rank}")  # a folder per rank: no rank sees another's incident
    rec = None
    if scenario != "rank0-only" or rank == 0:  # rank0-only: tooling on rank 0 only, the others train without it
        rec = reprokit.Recorder(state, train_step, build=build, config=config, out_dir=out_dir,
                                snapshot_every=4 if scenario == "raise-late" else 2,
                                incident_wait_s=20, replicated_state=scenario.endswith("-replicated"))
    plan = SCENARIOS.get(scenario, {} if scenario == "split" else {1: {3: "raise"}}).get(rank, {})
    g = torch.Generator().manual_seed(rank)
    for step in range(12):
        x = torch.randn(8, 8, generator=g)
        batch = {"x": x, "y": x.sum(1), "boom": torch.tensor(False)}
        what = plan.get(step)
        if what == "nan":
            batch["x"][0, 0] = float("nan")
        elif what == "raise":
            batch["boom"] = torch.tensor(True)
        if scenario == "exit-unclosed":
            batch["late"] = torch.tensor(what == "late")
        try:
            rec.step(batch) if rec is not None else train_step(state, batch)
        except (reprokit.TrainingFailure, IndexError) as e:
            print(f"rank {rank} step {step}: {type(e).__name__}: bundle {getattr(e, 'bundle', None)}", flush=True)
            if not scenario.startswith("recover"):
                raise
            # recover: restore finite weights (all ranks agree), skip this step
            with torch.no_grad():
                for p in state.model.parameters():
                    p.nan_to_num_(0.0)
                    dist.broadcast(p, 0)
    print(f"rank {rank} bundles: {[str(b) for b in rec.bundles] if rec else None}", flush=True)
    if scenario == "exit-unclosed":
        # A script that ends without rec.close(), right after a peer's incident appeared (its watcher is in its
        # grace second): interpreter exit must not cut the window off.
        deadline = time.monotonic() + 30
        while not list(Path(out_dir, ".reprokit-incidents").glob("*.0.json")) and time.monotonic() < deadline:
            time.sleep(0.01)
        print(f"rank {rank} exits with the incident unwritten: {rec.bundles == []}", flush=True)
        return
    # Tear down as a training script should, while the interpreter is fully alive: the incident watcher stopped, the
    # DDP model dropped (its reducer holds the process group, so destroy_process_group alone leaves gloo's worker
    # threads to interpreter exit, where gloo aborted a rank now and then on a loaded machine: "terminate called
    # without an active exception", after main had finished), then the process group destroyed.
    if rec is not None:
        rec.close()
    del rec, state
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} tore down", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3])
