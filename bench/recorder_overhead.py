"""Recorder overhead on a GPT-2-124M-shaped training step, measured side by side in one process.

    python bench/recorder_overhead.py            # GPU: GPT-2 124M, batch 8x1024, bf16 autocast, fused AdamW
    python bench/recorder_overhead.py --quick    # CPU smoke run: a tiny GPT, a few steps (timings meaningless)
    python bench/recorder_overhead.py --json

Variants run on the same model in short interleaved blocks (10 steps; the order
rotates every round) so drift in GPU clocks and host load hits all alike, and the
ratio comes with a 95% interval from the per-round pairs; "bare (A/A)" is the bare
loop measured as if it were a variant, i.e. the noise floor. Variants: bare
loop; Recorder defaults (loss/grad checks every step, snapshot every 100 steps,
window kept); the same with durable=True (the window also written behind to a
flight log on local disk: disk bytes and write rate printed beside the disk's own
write rate); with param checks too; without the grad check; without snapshots;
detect_anomaly;
transformers' DebugUnderflowOverflow (when importable). Every step reads the
loss with .item(), as real loops do. Snapshot cost is compared with the copy
limit measured in the same run: state bytes / pinned device-to-host bandwidth.

That table synchronizes around every step, which hides what a recorder costs a loop
that lets the host queue the next steps while the device runs (torchtitan reads the
loss every 10 steps, Megatron every 100). The loop-shape table ("loop/50", "loop/10",
"loop/1") times exactly that: blocks of --loop-block steps (default 100) with one
synchronize at the block's end and the loss read (``.item()``) every 50, 10 or 1
steps, bare loop and recorder (defaults) alternating, the order rotating each round.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from io_bench import _commit  # the checkout's commit, or $BENCH_COMMIT
from paired import ci95

import reprokit

from gpt import GPT, GPT2, train_step  # bench/gpt.py (bench/ is the script's folder)


def cuda_bench_config() -> dict:
    """The bench config on CUDA, TF32 matmuls on (as in every GPU table); exits when there is no GPU."""
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = True
    return {**GPT2, "device": "cuda"}


def timed(spent: dict, obj, name: str) -> None:
    """Replace ``obj.name`` by a wrapper adding its host seconds to ``spent[name]``."""
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
    setattr(obj, name, wrapper)


def build(config):
    torch.manual_seed(0)
    model = GPT(config["layers"], config["d"], config["heads"], config["vocab"], config["ctx"]).to(config["device"])
    fused = config["device"] == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=fused)
    return reprokit.TrainState(model=model, optimizer=opt)


def make_batch(cfg, g):
    idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["ctx"] + 1), device=cfg["device"], generator=g)
    return {"idx": idx[:, :-1], "targets": idx[:, 1:]}


def sync(device):
    """Wait for the training stream only: side-stream work (snapshot copies) that spills into the next step counts."""
    if device == "cuda":
        torch.cuda.current_stream().synchronize()


def d2h_bandwidth(nbytes: int) -> float:
    """Pinned device-to-host copy bandwidth, bytes/s (best of 5)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    best = math.inf
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


LOOPS = {"loop/50": 50, "loop/10": 10, "loop/1": 1}
"""Loop shapes: the loss is read (``.item()``, the loop's only sync) every this many steps."""


def loop_shapes(names: list[str], rec, state, cfg: dict, g, device: str, args, extra=None) -> dict:
    """Bare loop vs ``rec`` in loops that let the host run ahead: per shape, ms/step over blocks with one synchronize
    at each block's end and the loss read every N steps; the ratio with a 95% interval over paired rounds. ``extra``
    (name -> recorder: ``max_lag=0``, a recorder judging every step at its own end as before lagged checks, or one of
    the ablation variants) adds an arm per entry to each round, its ratio printed beside."""
    if not names:
        return {}
    n = args.loop_block or (4 if args.quick else 100)
    rounds = args.loop_rounds or (1 if args.quick else 6)

    arms = {"bare": None, "recorder": rec, **(extra or {})}

    def block(arm: str, every: int) -> float:
        r = arms[arm]
        if r is not None:
            r.attach()
        try:
            batches = [make_batch(cfg, g) for _ in range(n)]  # made before the clock starts, as a loader's are
            sync(device)
            t0 = time.perf_counter()
            for i, batch in enumerate(batches):
                loss = r.step(batch) if r is not None else train_step(state, batch)
                if (i + 1) % every == 0:
                    loss.item()
            sync(device)
            return (time.perf_counter() - t0) / n
        finally:
            if r is not None:
                r.detach()

    def ratio(rows: list[dict], arm: str) -> dict:
        bare = statistics.mean(t["bare"] for t in rows)
        mean = statistics.mean(t[arm] for t in rows)
        out = {"ms": mean * 1e3, "ratio": mean / bare}
        r = [t[arm] / t["bare"] for t in rows]
        if (ci := ci95(r)) is not None:
            out["ratio_ci95"] = ci
        return out

    before = rec.monitor.checks.stats()
    table: dict = {}
    for name in names:
        every = LOOPS[name]
        for arm in arms:  # warm-up: this shape's pace, every way
            block(arm, every)
        rows = []
        order = list(arms)
        for i in range(rounds):
            turn = order[i % len(order):] + order[:i % len(order)]  # rotate: no arm always follows another
            rows.append({arm: block(arm, every) for arm in turn})
        bare = statistics.mean(t["bare"] for t in rows)
        main = ratio(rows, "recorder")
        row = {"every": every, "bare_ms": bare * 1e3, "recorder_ms": main["ms"], "ratio": main["ratio"],
               "steps": n * rounds}
        if "ratio_ci95" in main:
            row["ratio_ci95"] = main["ratio_ci95"]
        for arm in extra or {}:
            row[arm] = ratio(rows, arm)
        table[name] = row
    after = rec.monitor.checks.stats()
    lag = {"lag_max": after["lag_max"], "lag_mean": after["lag_mean"],
           "lag_waits": after["lag_waits"] - before["lag_waits"]}
    return {"block": n, "rounds": rounds, "shapes": table, "detection_lag": lag}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="tiny model on CPU, few steps, snapshots every 10 steps instead of 100 (smoke run)")
    ap.add_argument("--block", type=int, default=None, help="steps per block (default 10, quick 2)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds of one block per variant, order rotated each round (default 80, quick 2)")
    ap.add_argument("--only", default=None, help="comma-separated variants to time (default: all); the loop shapes "
                    "are loop/50, loop/10, loop/1; loop:max_lag=0 adds a recorder judging every step at its end "
                    "to them, loop:VARIANT (e.g. loop:recorder-no-snapshot) one of the variants above")
    ap.add_argument("--loop-block", type=int, default=None,
                    help="steps per block of the loop-shape table (default 100, quick 4)")
    ap.add_argument("--loop-rounds", type=int, default=None,
                    help="rounds of the loop-shape table, one block each of bare and recorder (default 6, quick 1)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    device = "cuda" if cuda else "cpu"
    if args.quick:
        cfg = {"layers": 2, "d": 64, "heads": 4, "vocab": 256, "ctx": 32, "batch": 2}
    else:
        cfg = dict(GPT2)
    cfg["device"] = device
    steps = args.block or (2 if args.quick else 10)
    rounds = args.rounds or (2 if args.quick else 80)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    state = build(cfg)
    g = torch.Generator(device=device).manual_seed(1)
    out_dir = Path(tempfile.mkdtemp(prefix="reprokit-bench-"))

    # The warm-up fills one whole window and takes the next snapshot: 102 steps at the default snapshot_every=100;
    # --quick (a smoke run, figures meaningless) takes the same path with a window of 10 steps in 12.
    window = 10 if args.quick else 100
    warm_steps = window + 2

    def recorder(**kw):
        kw.setdefault("snapshot_every", window)
        return reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=out_dir, **kw)

    recs = {"recorder": recorder(), "recorder+durable": recorder(durable=True),
            "recorder+checks": recorder(check_params=True),
            "recorder-no-grad-check": recorder(check_grads=False),
            "recorder-no-snapshot": recorder(snapshot_every=10**9), "detection-only": recorder(snapshot_every=10**9),
            "experiment:fused-finite-check": recorder(check_grads=False), "instrumented": recorder()}
    loop_arms = [v.split(":", 1)[1] for v in (args.only or "").split(",") if v.startswith("loop:")]
    if "max_lag=0" in loop_arms:
        recs["loop:max_lag=0"] = recorder(max_lag=0)
    unknown = [a for a in loop_arms if a != "max_lag=0" and a not in recs]
    if unknown:
        raise SystemExit(f"unknown loop arm(s) {unknown}: loop:max_lag=0 or loop:<one of {sorted(recs)}>")
    for r in recs.values():
        r.detach()
    # Ablation: the detectors alone (no batch, RNG or snapshot recording), to split the cost.
    recs["detection-only"]._record_step_start = lambda k, batch: None  # type: ignore[method-assign]

    # Experiment (not a recorder option): the recorder without its grad norm, plus the fused non-finite check
    # GradScaler uses (one output; it multiplies the grads by 1.0 in place). Prices the host cost of the norm.
    found, one = torch.zeros(1, device=device), torch.ones(1, device=device)

    def fused_finite_check(opt, *_):
        grads = [p.grad for grp in opt.param_groups for p in grp["params"] if p.grad is not None]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)

    def run_block(name: str, n: int) -> list[float]:
        times = []
        rec = recs.get(name)
        if rec:
            rec.attach()
        hook = state.optimizer.register_step_pre_hook(fused_finite_check) if name.startswith("experiment:") else None
        ctx = torch.autograd.detect_anomaly(check_nan=True) if name == "detect_anomaly" else None
        try:
            if ctx:
                ctx.__enter__()
            for _ in range(n):
                batch = make_batch(cfg, g)
                sync(device)
                t0 = time.perf_counter()
                loss = rec.step(batch) if rec else train_step(state, batch)
                loss.item()
                times.append(time.perf_counter() - t0)
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
            if rec:
                rec.detach()
            if hook:
                hook.remove()
        return times

    # Where the recorder's time goes (host seconds inside its own methods), measured on a separate,
    # instrumented recorder so the wrappers do not weigh on the ratios above.
    spent: dict[str, float] = {}
    inst = recs["instrumented"]
    for obj, name in ((inst, "_record_step_start"), (inst, "_take_snapshot"), (inst, "_after_step"),
                      (inst.monitor, "_measure"), (inst.monitor, "_check"), (inst.monitor, "_on_optimizer_step"),
                      (inst.monitor, "_after_optimizer_step")):
        timed(spent, obj, name)

    # Warm up: kernels, the caching allocators, and each recorder's pinned snapshot buffers.
    # Steady state is what a long run sees: every recorder fills one whole window (pinned batch
    # slots) and takes a snapshot with optimizer state; that one-time allocation is reported apart.
    run_block("bare", 3)
    variants = ["bare", "recorder", "recorder+durable", "recorder+checks", "recorder-no-grad-check",
                "recorder-no-snapshot", "detection-only",
                "experiment:fused-finite-check", "bare (A/A)"]
    loops = list(LOOPS)
    if args.only:
        variants = ["bare"] + [v for v in args.only.split(",") if v in variants and v != "bare"]
        loops = [v for v in args.only.split(",") if v in LOOPS]
    warm = [name for name in recs if name in variants or name in ("recorder", "instrumented", "loop:max_lag=0")
            or name in loop_arms]
    warm_start = time.perf_counter()
    for name in warm:
        run_block(name, warm_steps)
    warmup_s = time.perf_counter() - warm_start - len(warm) * warm_steps * statistics.median(run_block("bare", 5))
    results: dict[str, list[float]] = {v: [] for v in variants}
    blocks: dict[str, list[float]] = {v: [] for v in variants}  # per-round block means
    for i in range(rounds):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:  # rotate: no variant always follows another
            t = run_block("bare" if v == "bare (A/A)" else v, steps)
            results[v] += t
            blocks[v].append(statistics.mean(t))
    spent.clear()
    n_inst = 4 if args.quick else 100
    first = inst.step_index
    snap_steps: list[int] = []
    take = inst._take_snapshot
    inst._take_snapshot = lambda k: (snap_steps.append(k), take(k))[1]  # type: ignore[method-assign]
    inst_times = run_block("instrumented", n_inst)
    spent_in_blocks = dict(spent)
    # What a snapshot costs the step that takes it (host blocking + the optimizer waiting for the copy).
    plain = statistics.median(inst_times)
    snapshot_step_extra_ms = [(inst_times[k - first] - plain) * 1e3 for k in snap_steps if 0 <= k - first < n_inst]
    slow_steps = 2 if args.quick else 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled..."
        results["detect_anomaly"] = run_block("detect_anomaly", slow_steps)

    loop_table = loop_shapes(loops, recs["recorder"], state, cfg, g, device, args,
                             extra={a: recs["loop:max_lag=0" if a == "max_lag=0" else a] for a in loop_arms})

    # Snapshot cost against the copy limit measured now.
    rec = recs["recorder"]
    rec.attach()
    snap = {}
    if cuda:
        state_bytes = sum(t.numel() * t.element_size() for t in state.model.state_dict().values()) + sum(
            v.numel() * v.element_size() for s in state.optimizer.state.values() for v in s.values()
            if isinstance(v, torch.Tensor))
        bw = d2h_bandwidth(1 << 30)
        walls = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            rec._take_snapshot(rec.step_index)
            host = time.perf_counter() - t0
            rec._engine.wait()
            walls.append((time.perf_counter() - t0, host))
        wall = min(w for w, _ in walls)
        snap = {"state_bytes": state_bytes, "d2h_GBps": bw / 1e9, "copy_limit_ms": state_bytes / bw * 1e3,
                "wall_ms": wall * 1e3, "wall_over_limit": wall / (state_bytes / bw),
                "host_blocking_ms": statistics.median(h for _, h in walls) * 1e3,
                "pinned_host_bytes": rec.snapshot_stats["pinned_bytes"]}
        # Extra GPU memory held by the recorder while training: measure around a recorded block.
        torch.cuda.synchronize()
        before, reserved_before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        run_block("bare", 3)
        peak_bare = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        rec.snapshot_every = 1  # every step of this block takes a snapshot: the peak includes staging clones
        run_block("recorder", 3)
        rec.snapshot_every = 100
        peak_rec = torch.cuda.max_memory_allocated()
        snap["extra_gpu_bytes_steady"] = torch.cuda.memory_allocated() - before
        snap["extra_gpu_bytes_peak"] = peak_rec - peak_bare
        snap["extra_gpu_bytes_reserved"] = torch.cuda.memory_reserved() - reserved_before
        snap["staged_bytes_in_training"] = inst.snapshot_stats["staged_bytes"]
        snap["waited_for_copy_in_training"] = inst.snapshot_stats["waited_for_copy"]
        # Spill-to-disk snapshots: the synchronous cost, for states too big for host RAM.
        spill = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=out_dir,
                                  spill_dir=out_dir / "spill")
        t0 = time.perf_counter()
        spill._take_snapshot(0)
        snap["spill_ms"] = (time.perf_counter() - t0) * 1e3
        snap["spill_GBps"] = state_bytes / (time.perf_counter() - t0) / 1e9
        spill.close()
    rec.detach()
    # Durable mode: what its flight log wrote (warm-up and timed blocks), and the disk's own sequential write rate.
    flight = recs["recorder+durable"]._flight
    if flight is not None:
        from io_bench import disk_write

        timed_steps = len(results.get("recorder+durable", []))
        n_durable = timed_steps + (warm_steps if "recorder+durable" in warm else 0)
        per_step = flight.stats["bytes"] / max(1, n_durable)
        on_disk = sum(p.stat().st_size for p in flight.folder.rglob("*") if p.is_file())
        probe = out_dir / "disk-probe"
        limit = disk_write(probe, max(64 << 20, int(per_step) * 100))
        probe.unlink(missing_ok=True)
        mean_step = statistics.mean(results["recorder+durable"]) if timed_steps else float("nan")
        snap["durable"] = {"bytes_written": flight.stats["bytes"], "records": flight.stats["records"],
                           "steps": n_durable, "bytes_per_step": per_step,
                           "writer_seconds": flight.stats["seconds"], "fsyncs": flight.stats["fsyncs"],
                           "bytes_on_disk_now": on_disk, "disk_write_Bps": limit,
                           "write_rate_Bps": per_step / mean_step}
    # Last, because its hooks cannot be removed.
    try:
        import transformers
        from transformers.debug_utils import DebugUnderflowOverflow
    except ImportError:
        pass
    else:
        if transformers.utils.is_torch_available():  # else this transformers disabled its torch half (torch too old)
            DebugUnderflowOverflow(state.model, max_frames_to_save=21)
            results["DebugUnderflowOverflow"] = run_block("DebugUnderflowOverflow", slow_steps)
    bare = statistics.mean(results["bare"])
    table = {name: {"mean_ms": statistics.mean(t) * 1e3, "median_ms": statistics.median(t) * 1e3,
                    "ratio": statistics.mean(t) / bare, "steps": len(t)} for name, t in results.items()}
    for name, per_round in blocks.items():
        # The ratio of each round's block to that round's bare block: drift between rounds cancels.
        r = [m / b for m, b in zip(per_round, blocks["bare"])]
        if (ci := ci95(r)) is not None:
            table[name]["ratio_ci95"] = ci
    breakdown = {name: sec / n_inst * 1e3 for name, sec in spent_in_blocks.items()}
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "commit": _commit(), "config": cfg, "variants": table, "snapshot": snap, "recorder_host_ms_per_step": breakdown,
              "one_time_warmup_s_all_recorders": warmup_s, "snapshot_step_extra_ms": snapshot_step_extra_ms,
              "recorder_memory": recs["recorder"].stats(), "loop_shapes": loop_table}
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"device {report['device']}, torch {report['torch']}, batch {cfg['batch']}x{cfg['ctx']}, "
          f"{cfg['layers']} layers d={cfg['d']}")
    print(f"{'variant':<26}{'mean ms':>10}{'median ms':>11}{'x bare':>8}{'95% CI (paired rounds)':>24}{'steps':>7}")
    for name, r in table.items():
        ci = "[{:.3f}, {:.3f}]".format(*r["ratio_ci95"]) if "ratio_ci95" in r else ""
        print(f"{name:<26}{r['mean_ms']:>10.2f}{r['median_ms']:>11.2f}{r['ratio']:>8.3f}{ci:>24}{r['steps']:>7}")
    if loop_table:
        print(f"loop shapes (one synchronize per {loop_table['block']}-step block, the loss read every N steps):")
        print(f"{'loop':<26}{'bare ms':>10}{'rec. ms':>10}{'x bare':>8}{'95% CI (paired rounds)':>24}{'steps':>7}")
        for name, r in loop_table["shapes"].items():
            ci = "[{:.3f}, {:.3f}]".format(*r["ratio_ci95"]) if "ratio_ci95" in r else ""
            print(f"{name:<26}{r['bare_ms']:>10.2f}{r['recorder_ms']:>10.2f}{r['ratio']:>8.3f}{ci:>24}{r['steps']:>7}")
            for arm in loop_arms:
                j = r[arm]
                ci = "[{:.3f}, {:.3f}]".format(*j["ratio_ci95"]) if "ratio_ci95" in j else ""
                label = "  recorder " + arm if arm == "max_lag=0" else "  " + arm
                print(f"{label:<26}{'':>10}{j['ms']:>10.2f}{j['ratio']:>8.3f}{ci:>24}")
        lag = loop_table["detection_lag"]
        print(f"detection lag in the loop shapes: max {lag['lag_max']} steps, mean {lag['lag_mean']:.2f}; the recorder "
              f"waited {lag['lag_waits']} times (postponed snapshots, checks max_lag old)")
    if "state_bytes" in snap:
        print(f"snapshot: {snap['state_bytes'] / 1e9:.2f} GB, wall {snap['wall_ms']:.1f} ms = "
              f"{snap['wall_over_limit']:.2f}x the copy limit ({snap['copy_limit_ms']:.1f} ms at "
              f"{snap['d2h_GBps']:.1f} GB/s); host blocking {snap['host_blocking_ms']:.2f} ms; pinned host "
              f"{snap['pinned_host_bytes'] / 1e9:.2f} GB; extra GPU steady {snap['extra_gpu_bytes_steady'] / 1e6:.1f} MB,"
              f" peak {snap['extra_gpu_bytes_peak'] / 1e6:.1f} MB, reserved {snap['extra_gpu_bytes_reserved'] / 1e6:.1f} MB")
        print(f"in training, the snapshot's last {snap['staged_bytes_in_training'] / 1e6:.0f} MB were staged on the "
              f"device (waited for the copy instead: {snap['waited_for_copy_in_training']})")
        print(f"spill-to-disk snapshot: {snap['spill_ms']:.0f} ms ({snap['spill_GBps']:.2f} GB/s)")
    if "durable" in snap:
        d = snap["durable"]
        print(f"durable: {d['bytes_written'] / 1e6:.1f} MB written in {d['records']} records over {d['steps']} steps "
              f"({d['bytes_per_step'] / 1e3:.1f} kB/step, {d['fsyncs']} snapshot commits with fsync), "
              f"{d['bytes_on_disk_now'] / 1e6:.1f} MB on disk now (at most two windows); write rate while training "
              f"{d['write_rate_Bps'] / 1e6:.1f} MB/s vs the disk's {d['disk_write_Bps'] / 1e6:.0f} MB/s sequential "
              f"write; time in the log's writes {d['writer_seconds']:.2f} s in all")
    print(f"one-time warm-up (pinned allocations) for the {len(recs)} recorders: {warmup_s:.2f} s")
    print("extra time of the step that takes a snapshot (vs the median step): "
          + ", ".join(f"{x:.1f} ms" for x in snapshot_step_extra_ms))
    print("recorder host ms per step: " + ", ".join(f"{k} {v:.3f}" for k, v in breakdown.items()))
    mem = report["recorder_memory"]
    print(f"recorder host memory (defaults): peak pinned {mem['peak_pinned_bytes'] / 1e9:.2f} GB, peak pageable "
          f"{mem['peak_pageable_bytes'] / 1e6:.1f} MB, budget {mem['budget_bytes'] / 1e9:.1f} GB, window "
          f"{mem['window_steps']} steps / {mem['window_bytes'] / 1e6:.1f} MB, early snapshots {mem['early_snapshots']}")


if __name__ == "__main__":
    sys.exit(main())
