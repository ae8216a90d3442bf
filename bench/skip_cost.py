"""How many seconds does ``Recorder(on_failure="skip")`` lose on a poisoned sample, against a restart from the last
checkpoint?

    python bench/skip_cost.py --save bench/results/skip_cost-<device>-<commit>.json   # GPU: GPT-2 124M
    python bench/skip_cost.py --quick --json                                         # CPU smoke run

GPT-2 124M (bench/gpt.py), batch 8x1024, bf16 autocast, fused AdamW, a snapshot every ``--snapshot-every`` steps.
Each row of a batch carries a loss weight; one sample's weight is NaN (a poisoned sample: its row makes the loss
NaN) at step ``--poison-step``. The run trains ``--steps`` steps under the recorder with ``on_failure="skip"``; the
step that meets the poisoned sample writes its bundle, replays the window to prove the row is the cause, replays it
without the row and goes on. What that step lost is its wall time over a bare step (everything in: the bundle
write, the replays, the rows pass); the journal's ``seconds_lost`` (the replays alone) is printed beside it.

The restart it is compared with is what a run without reprokit does: stop, load the checkpoint taken at the last
snapshot's step (``torch.save`` of the model's and the optimizer's state dicts, written and read in this run on the
same disk, its pages dropped from the page cache first), and train again every step since it. Not counted there,
so the restart figure is a lower bound: a new process, CUDA's start, the job queue, fast-forwarding the data loader,
and finding the sample to drop by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional as F

import reprokit
from reprokit.skip_journal import read_journal

sys.path.insert(0, str(Path(__file__).parent))
from io_bench import _commit, drop_cache, save_and_print  # noqa: E402
from recorder_overhead import build  # noqa: E402

from gpt import GPT2  # noqa: E402

QUICK = {"layers": 2, "d": 64, "heads": 4, "vocab": 256, "ctx": 32, "batch": 4}


def weighted_step(state, batch):
    """The bench's GPT step with a loss weight per row (a NaN weight is the poisoned sample)."""
    idx, targets = batch["idx"], batch["targets"]
    with torch.autocast(idx.device.type, dtype=torch.bfloat16):
        logits = state.model(idx)
    per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    loss = (per_token.view(idx.shape).mean(1) * batch["weight"]).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(cfg: dict, steps: int, poison: tuple[int, int] | None) -> list[dict]:
    """One batch per step, made before the clock starts; ``poison = (step, row)`` gets a NaN weight."""
    g = torch.Generator(device=cfg["device"]).manual_seed(0)
    out = []
    for s in range(steps):
        idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["ctx"] + 1), device=cfg["device"], generator=g)
        weight = torch.ones(cfg["batch"], device=cfg["device"])
        if poison and s == poison[0]:
            weight[poison[1]] = float("nan")
        index = torch.arange(s * cfg["batch"], (s + 1) * cfg["batch"], device=cfg["device"])
        out.append({"idx": idx[:, :-1], "targets": idx[:, 1:], "weight": weight, "index": index})
    return out


def sync(cfg: dict) -> None:
    if cfg["device"] == "cuda":
        torch.cuda.synchronize()


def checkpoint_load_s(state, cfg: dict, folder: Path) -> dict[str, Any]:
    """Save the state as a checkpoint, drop its pages, and time loading it back into the model and optimizer."""
    path = folder / "checkpoint.pt"
    torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict()}, path)
    dropped = drop_cache([path])
    sync(cfg)
    t0 = time.perf_counter()
    ckpt = torch.load(path, map_location=cfg["device"], weights_only=True)
    state.model.load_state_dict(ckpt["model"])
    state.optimizer.load_state_dict(ckpt["optimizer"])
    sync(cfg)
    return {"seconds": time.perf_counter() - t0, "bytes": path.stat().st_size, "page_cache_dropped": dropped}


def run(cfg: dict, args) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="skip-cost-"))
    poison = (args.poison_step, 3 % cfg["batch"])
    data = batches(cfg, args.steps, poison)
    # bare steps on a model of its own: the step time the restart recomputes
    bare = build(cfg)
    for b in data[:args.warmup]:
        weighted_step(bare, b).item()
    sync(cfg)
    bare_times = []
    for b in data[:args.bare_steps]:
        t0 = time.perf_counter()
        weighted_step(bare, b).item()
        bare_times.append(time.perf_counter() - t0)
    load = checkpoint_load_s(bare, cfg, folder)
    del bare
    if cfg["device"] == "cuda":
        torch.cuda.empty_cache()
    bare_step = statistics.median(bare_times)

    state = build(cfg)
    rec = reprokit.Recorder(state, weighted_step, build=build, config=cfg, out_dir=folder / "repros",
                            snapshot_every=args.snapshot_every, on_failure="skip", skip_budget_s=args.budget)
    times = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in data:
            t0 = time.perf_counter()
            rec.step(b).item()
            times.append(time.perf_counter() - t0)
    rec.close()
    said = [str(w.message) for w in caught if issubclass(w.category, reprokit.RecorderWarning)]
    journal = read_journal(folder / "repros")
    if len(journal) != 1:
        raise SystemExit(f"expected one skip in the journal, found {len(journal)}; the recorder said: {said}")
    (entry,) = journal
    if entry["dataset_indices"] != [poison[0] * cfg["batch"] + poison[1]]:
        raise SystemExit(f"the skip named {entry['dataset_indices']}, not the poisoned sample")
    others = [t for i, t in enumerate(times) if i != args.poison_step and i >= args.warmup]
    recorded_step = statistics.median(others)
    skip_step = times[args.poison_step]
    lost = skip_step - recorded_step
    last_snapshot = (args.poison_step // args.snapshot_every) * args.snapshot_every
    since = args.poison_step - last_snapshot
    restart = load["seconds"] + since * bare_step
    return {
        "benchmark": "skip_cost", "commit": _commit(), "device": device_name(cfg), "torch": torch.__version__,
        "config": {**cfg, "steps": args.steps, "snapshot_every": args.snapshot_every, "poison_step": args.poison_step},
        "bare_step_s": bare_step, "recorded_step_s": recorded_step,
        "skip": {"step_s": skip_step, "lost_s": lost, "journal_seconds_lost": entry["seconds_lost"],
                 "steps_replayed_since_snapshot": since, "dataset_indices": entry["dataset_indices"],
                 "replays": entry["evidence"].get("replays")},
        "restart": {"checkpoint_load_s": load["seconds"], "checkpoint_bytes": load["bytes"],
                    "page_cache_dropped": load["page_cache_dropped"], "steps_since_checkpoint": since,
                    "recompute_s": since * bare_step, "total_s": restart,
                    "not_counted": "new process, CUDA start, job queue, data-loader fast-forward, finding the sample"},
        "skip_over_restart": lost / restart,
        "warnings": said,
    }


def device_name(cfg: dict) -> str:
    if cfg["device"] == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({os.cpu_count()} cores)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a tiny CPU smoke run (figures meaningless)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--snapshot-every", type=int, default=100)
    p.add_argument("--poison-step", type=int, default=160, help="the step whose batch holds the poisoned sample")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--bare-steps", type=int, default=50)
    p.add_argument("--budget", type=float, default=120.0, help="skip_budget_s")
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", type=Path)
    args = p.parse_args()
    if args.quick:
        cfg = {**QUICK, "device": "cpu"}
        args.steps, args.snapshot_every, args.poison_step, args.warmup, args.bare_steps = 16, 8, 13, 2, 4
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs CUDA (or --quick)")
        torch.backends.cuda.matmul.allow_tf32 = True
        cfg = {**GPT2, "device": "cuda"}
    res = run(cfg, args)
    if save_and_print(res, args.save, args.json):
        return
    s, r = res["skip"], res["restart"]
    print(f"{res['device']}, commit {res['commit']}; bare step {res['bare_step_s'] * 1e3:.1f} ms, recorded step "
          f"{res['recorded_step_s'] * 1e3:.1f} ms")
    print(f"skip at step {res['config']['poison_step']}: the step took {s['step_s']:.2f} s, lost {s['lost_s']:.2f} s "
          f"(journal: {s['journal_seconds_lost']:.2f} s of replays), samples {s['dataset_indices']}")
    print(f"restart from the checkpoint {r['steps_since_checkpoint']} steps back: load {r['checkpoint_load_s']:.2f} s "
          f"({r['checkpoint_bytes'] / 1e9:.2f} GB) + {r['recompute_s']:.2f} s of steps = {r['total_s']:.2f} s "
          f"(not counted: {r['not_counted']})")
    print(f"skip / restart: {res['skip_over_restart']:.2f}")
    print(json.dumps(res["warnings"]) if res["warnings"] else "")


if __name__ == "__main__":
    main()
