"""Why does the gradient check cost more under DDP than on one GPU? (GPT-2-124M, NCCL, every GPU of the host)

    PYTHONPATH=bench python -m torch.distributed.run --nproc_per_node 2 bench/probes/ddp_gradcheck_probe.py \
        [--rounds 30] [--trace-dir DIR]

Same model, step and protocol as ddp_overhead.py (10-step blocks, order rotated every round, the training
stream synchronised before each step, ``loss.item()`` inside the step), with these variants:

- ``recorder``: the defaults; ``no-grad-check``: ``check_grads=False``.
- ``grad-inline``: the recorder, its norm taken in line on the training stream (no side stream).
- ``grad-no-record``: the recorder, its side-stream norm without ``record_stream`` on the gradients.
- ``grad-hook-host``: the recorder's pre-hook gathers the gradients and returns (its host work, no norm).
- ``bare+side-norm``: no recorder; the bare step with the same side-stream norm in optimizer hooks, read with
  the loss in one transfer.
- ``bare+bucket-norm``: no recorder; each gradient's norm taken as DDP hands it back (a post-accumulate hook
  on the side stream per ~32 MB of gradients), read with the loss.

With ``--trace-dir``, rank 0 profiles 6 steps of ``bare``, ``recorder`` and ``no-grad-check`` (torch.profiler,
CPU + CUDA) and prints, per variant, each step's wall time, the GPU's busy time (union of kernels), the time from
the last NCCL kernel's end to the step's end, and the kernels that differ from ``no-grad-check``.
"""

from __future__ import annotations

import argparse
import datetime
import gzip
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from ddp_overhead import build

import reprokit
from reprokit.detect import _amp_adjusted, _norm_of_groups, group_by_device_dtype

from gpt import GPT2, train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--trace-dir", default=None)
    args = ap.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    cfg = {**GPT2, "device": "cuda"}
    state = build(cfg)
    opt = state.optimizer
    g = torch.Generator(device="cuda").manual_seed(rank)
    out = Path(tempfile.mkdtemp())

    def recorder(name: str, **kw) -> reprokit.Recorder:
        r = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=out / name, incident_wait_s=120, **kw)
        r.detach()
        return r

    recs = {"recorder": recorder("recorder"), "no-grad-check": recorder("ngc", check_grads=False)}
    recs["grad-inline"] = recorder("inline")
    m = recs["grad-inline"].monitor
    m._norm_aside = lambda grads, found_inf=None: _amp_adjusted(_norm_of_groups(grads), None, found_inf)
    recs["grad-no-record"] = recorder("norecord")
    m = recs["grad-no-record"].monitor

    def aside_no_record(grads, found_inf=None, m=m):
        dev = grads[0][0].device
        side = m._side.get(dev) or m._side.setdefault(dev, torch.cuda.Stream(device=dev))
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            norm = _amp_adjusted(_norm_of_groups(grads), None, found_inf)
        m._unjoined.append(side)
        return norm
    m._norm_aside = aside_no_record
    recs["grad-hook-host"] = recorder("hookhost")
    m = recs["grad-hook-host"].monitor
    m._norm_aside = lambda grads, found_inf=None: None
    orig_pre = m._on_optimizer_step

    def pre_host(o, a, kw, m=m, orig=orig_pre):
        orig(o, a, kw)
        m._norms.clear()
    m._on_optimizer_step = pre_host

    params = [p for grp in opt.param_groups for p in grp["params"]]
    groups = group_by_device_dtype(params)
    side = torch.cuda.Stream()
    box: dict[str, object] = {"norm": None, "parts": [], "pending": [], "bytes": 0}

    def pre_side(*_):
        gs = [[p.grad for p in ps if p.grad is not None] for ps in groups]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            box["norm"] = _norm_of_groups(gs)
        for grp in gs:
            for t in grp:
                t.record_stream(side)

    def post_join(*_):
        torch.cuda.current_stream().wait_stream(side)

    def flush():
        if not box["pending"]:
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            box["parts"].append(torch.stack(torch._foreach_norm(box["pending"], 2, dtype=torch.float64))
                                .square().sum())
        for t in box["pending"]:
            t.record_stream(side)
        box["pending"], box["bytes"] = [], 0

    def on_grad(p):
        box["pending"].append(p.grad)
        box["bytes"] += p.grad.numel() * p.grad.element_size()
        if box["bytes"] >= 32 << 20:
            flush()

    def pre_bucket(*_):
        flush()
        with torch.cuda.stream(side):
            box["norm"] = torch.stack(box["parts"]).sum().sqrt()
        box["parts"] = []

    def bare_with(pre, post=post_join, per_param=False):
        def step(b):
            handles = [opt.register_step_pre_hook(pre), opt.register_step_post_hook(post)]
            if per_param:
                handles += [p.register_post_accumulate_grad_hook(on_grad) for p in params]
            try:
                loss = train_step(state, b)
            finally:
                for h in handles:
                    h.remove()
            n = box["norm"]
            got = torch.cat([loss.detach().reshape(1).double(), n.reshape(1)]).tolist()
            assert math.isfinite(got[1])
            return loss
        return step

    steps = {"bare": lambda b: train_step(state, b), **{k: r.step for k, r in recs.items()},
             "bare+side-norm": bare_with(pre_side), "bare+bucket-norm": bare_with(pre_bucket, per_param=True)}

    def batch():
        idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["ctx"] + 1), device="cuda", generator=g)
        return {"idx": idx[:, :-1], "targets": idx[:, 1:]}

    def block(name: str, n: int, prof=None) -> list[float]:
        r = recs.get(name)
        if r is not None:
            r.attach()
        times = []
        try:
            for _ in range(n):
                b = batch()
                torch.cuda.current_stream().synchronize()
                t0 = time.perf_counter()
                with torch.profiler.record_function("probe_step"):
                    steps[name](b).item()
                times.append(time.perf_counter() - t0)
                if prof is not None:
                    prof.step()
        finally:
            if r is not None:
                r.detach()
        return times

    for name in steps:
        block(name, 60)
    variants = [*steps, "bare (A/A)"]
    means: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(args.rounds):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:
            means[v].append(statistics.mean(block("bare" if v == "bare (A/A)" else v, args.block)))
    if rank == 0:
        print(f"{'variant':<20}{'mean ms':>9}{'x bare':>8}  95% CI (paired rounds)")
    for v in variants:
        r = [a / b for a, b in zip(means[v], means["bare"])]
        half = 1.96 * statistics.stdev(r) / math.sqrt(len(r))
        print(f"rank {rank} {v:<20}{statistics.mean(means[v]) * 1e3:>9.2f}{statistics.mean(r):>8.3f}  "
              f"[{statistics.mean(r) - half:.3f}, {statistics.mean(r) + half:.3f}]", flush=True)
    dist.barrier()
    if args.trace_dir:
        profile(args, block, rank)
    dist.barrier()
    for r in recs.values():
        r.close()
    dist.destroy_process_group()


def profile(args: argparse.Namespace, block, rank: int) -> None:
    from torch.profiler import ProfilerActivity
    kernels: dict[str, dict[str, float]] = {}
    for name in ("bare", "recorder", "no-grad-check"):
        with tempfile.TemporaryDirectory() as tmp:
            with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                block(name, 6)
            if rank != 0:
                continue
            path = Path(tmp) / "t.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
        with gzip.open(Path(args.trace_dir) / f"trace_{name}.json.gz", "wt") as f:
            json.dump(trace, f)
        ev = trace["traceEvents"]
        steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("name") == "probe_step" and "dur" in e
                       and e.get("cat") == "user_annotation")
        kern = [e for e in ev if e.get("cat") == "kernel"]
        print(f"== {name}: {len(steps)} steps, {len(kern)} kernels")
        per: dict[str, float] = {}
        for k in kern:
            per[k["name"][:70]] = per.get(k["name"][:70], 0.0) + k["dur"]
        kernels[name] = per
        for s0, s1 in steps[1:]:
            ks = sorted((k["ts"], k["ts"] + k["dur"], k) for k in kern if s0 <= k["ts"] < s1 + 5e4)
            busy, end = 0.0, -1.0
            for a, b, _ in ks:
                if b > end:
                    busy += b - max(a, end)
                    end = b
            nccl = [b for a, b, k in ks if "nccl" in k["name"].lower()]
            streams: dict[int, float] = {}
            for a, b, k in ks:
                streams[k["args"].get("stream", -1)] = streams.get(k["args"].get("stream", -1), 0.0) + b - a
            last = max(b for a, b, _ in ks) if ks else s1
            print(f"  wall {(s1 - s0) / 1e3:7.2f} ms  gpu busy {busy / 1e3:7.2f} ms  first kernel +"
                  f"{((ks[0][0] - s0) / 1e3) if ks else 0:5.2f} ms  last nccl -> last kernel "
                  f"{((last - max(nccl)) / 1e3) if nccl else 0:5.2f} ms  streams "
                  + ", ".join(f"{s}:{t / 1e3:.2f}" for s, t in sorted(streams.items())))
    if rank == 0 and "recorder" in kernels:
        base = kernels["no-grad-check"]
        diff = sorted(((v / 6 - base.get(k, 0.0) / 6, k) for k, v in kernels["recorder"].items()), reverse=True)
        print("kernels: recorder - no-grad-check, us per step")
        for d, k in diff[:12]:
            print(f"  {d:9.1f}  {k}")


if __name__ == "__main__":
    main()
