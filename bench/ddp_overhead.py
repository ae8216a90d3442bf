"""Recorder overhead on a DDP training step, every rank measured side by side in one run; each rank's dump time.

    python bench/ddp_overhead.py                 # every GPU of this host: GPT-2 124M under DDP (NCCL), bf16 autocast
    python bench/ddp_overhead.py --quick         # 2 CPU ranks (gloo), a tiny GPT, a few steps (timings meaningless)
    python bench/ddp_overhead.py --json --save bench/results

It starts itself under ``torch.distributed.run`` (one process per GPU, or two on the CPU; with --quick the
launcher is forked from the bench's process, the ranks fresh). Each rank runs the bare
DDP step and the step through ``Recorder.step`` in short interleaved blocks (10 steps; the order rotates every
round), so drift hits both alike; "bare (A/A)" is the bare step timed as if it were a variant: the noise floor. A
step's time includes ``loss.item()``, as real loops do, and the all-reduce, so a slow rank slows every rank. Then
the loop shapes (``--loops``, default 50,10,1): blocks of ``--loop-block`` steps with one synchronize at the end and
the loss read every N steps, so the host queues steps ahead of the device as real loops let it; bare and recorder
alternate. Then rank 1 feeds a NaN: each rank's time to write its window into the incident folder is reported.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from io_bench import _commit  # the checkout's commit, or $BENCH_COMMIT
from paired import ci95
from torch.nn.parallel import DistributedDataParallel

import reprokit

from gpt import GPT, GPT2, train_step  # bench/gpt.py (bench/ is the script's folder)

QUICK = {"layers": 2, "d": 64, "heads": 4, "vocab": 256, "ctx": 32, "batch": 2}
EXTRA = {"recorder-no-grad-check": {"check_grads": False}, "recorder-no-snapshot": {"snapshot_every": 10**9}}
"""Recorders with one part off (``--variants``), timed beside the full one to find where its cost goes."""


def build(config):
    torch.manual_seed(0)
    device = config["device"]
    model = GPT(config["layers"], config["d"], config["heads"], config["vocab"], config["ctx"]).to(device)
    if dist.is_available() and dist.is_initialized():
        model = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if device == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=device == "cuda")
    return reprokit.TrainState(model=model, optimizer=opt)


def rank_main(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available() and not args.quick
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = True
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = {**(QUICK if args.quick else GPT2), "device": "cuda" if cuda else "cpu"}
    state = build(cfg)
    g = torch.Generator(device=cfg["device"]).manual_seed(rank)
    out_dir = Path(args.out)
    rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=out_dir, incident_wait_s=120)
    rec.detach()
    recs = {"recorder": rec}
    for name in args.variants.split(",") if args.variants else []:  # take the recorder apart, one part off at a time
        if name not in EXTRA:
            raise SystemExit(f"unknown variant {name!r}; known: {', '.join(EXTRA)}")
        # Its own out_dir: its incident watcher never sees the main recorder's incident below.
        recs[name] = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=out_dir / name,
                                       incident_wait_s=120, **EXTRA[name])
        recs[name].detach()

    def batch():
        idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["ctx"] + 1), device=cfg["device"], generator=g)
        return {"idx": idx[:, :-1], "targets": idx[:, 1:]}

    def block(name: str, n: int) -> list[float]:
        r = recs.get(name)
        if r is not None:
            r.attach()
        times = []
        try:
            for _ in range(n):
                b = batch()
                if cuda:
                    torch.cuda.current_stream().synchronize()
                t0 = time.perf_counter()
                loss = r.step(b) if r is not None else train_step(state, b)
                loss.item()
                times.append(time.perf_counter() - t0)
        finally:
            if r is not None:
                r.detach()
        return times

    def loop_block(name: str, n: int, every: int) -> float:
        """ms/step of ``n`` steps with one synchronize at the end and the loss read every ``every`` steps."""
        r = recs.get(name)
        if r is not None:
            r.attach()
        try:
            bs = [batch() for _ in range(n)]
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i, b in enumerate(bs):
                loss = r.step(b) if r is not None else train_step(state, b)
                if (i + 1) % every == 0:
                    loss.item()
            if cuda:
                torch.cuda.synchronize()
            return (time.perf_counter() - t0) / n * 1e3
        finally:
            if r is not None:
                r.detach()

    steps, rounds = (2, 2) if args.quick else (args.block, args.rounds)
    for name in ("bare", *recs):
        block(name, 3 if args.quick else 110)  # warm-up, the recorder's ring and first snapshot included
    variants = ["bare", *recs, "bare (A/A)"]
    results: dict[str, list[float]] = {v: [] for v in variants}
    means: dict[str, list[float]] = {v: [] for v in variants}
    for i in range(rounds):
        for v in variants[i % len(variants):] + variants[:i % len(variants)]:
            t = block("bare" if v == "bare (A/A)" else v, steps)
            results[v] += t
            means[v].append(statistics.mean(t))
    bare = statistics.mean(results["bare"])
    table = {}
    for v, t in results.items():
        r = [m / b for m, b in zip(means[v], means["bare"])]
        row = {"mean_ms": statistics.mean(t) * 1e3, "median_ms": statistics.median(t) * 1e3,
               "ratio": statistics.mean(t) / bare, "steps": len(t)}
        if (ci := ci95(r)) is not None:
            row["ratio_ci95"] = ci
        table[v] = row
    loops: dict[str, dict] = {}
    n_loop, loop_rounds = (4, 1) if args.quick else (args.loop_block, args.loop_rounds)
    looped = ["bare", *recs]  # the loop shapes time every recorder beside the bare loop, the order rotating each round
    for every in [int(x) for x in args.loops.split(",") if x]:
        for name in looped:
            loop_block(name, n_loop, every)  # warm-up, each way
        times: dict[str, list[float]] = {name: [] for name in looped}
        for i in range(loop_rounds):
            for name in looped[i % len(looped):] + looped[:i % len(looped)]:
                times[name].append(loop_block(name, n_loop, every))
        shape: dict[str, dict] = {}
        for name in looped[1:]:
            r = [b / a for a, b in zip(times["bare"], times[name])]
            row = {"bare_ms": statistics.mean(times["bare"]), "recorder_ms": statistics.mean(times[name]),
                   "steps": n_loop * loop_rounds}
            row["ratio"] = row["recorder_ms"] / row["bare_ms"]
            if (ci := ci95(r)) is not None:
                row["ratio_ci95"] = ci
            shape[name] = row
        loops[f"loop/{every}"] = {**shape["recorder"], "variants": {n: v for n, v in shape.items() if n != "recorder"}}
    # The incident: rank 1 feeds a NaN; every rank writes its window. Time each rank's own write.
    rec.attach()
    spent: dict[str, float] = {}
    dump = rec._dump

    def timed_dump(*a, **kw):
        t0 = time.perf_counter()
        try:
            return dump(*a, **kw)
        finally:
            spent["dump_s"] = time.perf_counter() - t0
    rec._dump = timed_dump  # type: ignore[method-assign]
    nan_batch = batch()
    failed = None
    t0 = time.perf_counter()
    try:
        if rank == 1:
            with torch.no_grad():  # a NaN in this rank's input embedding row: its loss and (all-reduced) grads go NaN
                emb = state.model.module.wte.weight
                saved = emb[nan_batch["idx"][0, 0]].clone()
                emb[nan_batch["idx"][0, 0]] = float("nan")
        rec.step(nan_batch)
        rec.wait_for_checks()  # its check may still be on its way (checks lag): judge it now
    except reprokit.TrainingFailure as e:
        failed = e.failure.kind
    finally:
        if rank == 1:
            with torch.no_grad():
                emb[nan_batch["idx"][0, 0]] = saved
    incident_s = time.perf_counter() - t0
    bundle = rec.bundles[-1] if rec.bundles else None
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file()) if bundle else 0
    doc = {"rank": rank, "world_size": world, "variants": table, "loop_shapes": loops, "failure": failed,
           "dump_s": spent.get("dump_s"), "incident_step_s": incident_s, "bundle_bytes": size,
           "recorder_memory": rec.stats(),
           "device": torch.cuda.get_device_name() if cuda else "cpu", "config": cfg}
    Path(args.report).joinpath(f"rank{rank}.json").write_text(json.dumps(doc))
    rec.close()
    os._exit(0)  # no destroy_process_group: a peer may still sit in a collective after the incident


def _torchrun(argv: list[str], env: dict[str, str], forked: bool) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run ARGV`` with ``env``, output captured. ``forked`` (--quick, a smoke run): the
    launcher is a process forked from this one (torch imported already: no torch import of its own) when this one
    has no other thread; it starts each rank as a fresh process all the same, as torchrun does."""
    cmd = [sys.executable, "-m", "torch.distributed.run", *argv]
    if not forked or threading.active_count() != 1:
        return subprocess.run(cmd, capture_output=True, text=True, env=env)
    import runpy
    import traceback

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                devnull = os.open(os.devnull, os.O_RDONLY)
                for fd, target in ((devnull, 0), (out.fileno(), 1), (err.fileno(), 2)):
                    os.dup2(fd, target)
                os.environ.clear()
                os.environ.update(env)
                sys.argv = ["torchrun", *argv]
                runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code & 0xFF)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, status, out.read(), err.read())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 CPU ranks, a tiny GPT, few steps (smoke run)")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: GPUs on this host, or 2 on the CPU)")
    ap.add_argument("--block", type=int, default=10, help="steps per block")
    ap.add_argument("--rounds", type=int, default=40, help="rounds of one block per variant")
    ap.add_argument("--variants", default="", help=f"also time recorders with one part off: {', '.join(EXTRA)}")
    ap.add_argument("--loops", default="50,10,1",
                    help="loop shapes: read the loss every N steps, one synchronize per block (comma-separated; '' for "
                         "none)")
    ap.add_argument("--loop-block", type=int, default=100, help="steps per block of the loop shapes")
    ap.add_argument("--loop-rounds", type=int, default=6,
                    help="rounds of the loop shapes, one block each of bare, recorder and every --variants recorder")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", default=None, help="folder to write ddp_overhead_<device>_<commit>.json into")
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--report", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return
    cuda = torch.cuda.is_available() and not args.quick
    nproc = args.nproc or (torch.cuda.device_count() if cuda else 2)
    with tempfile.TemporaryDirectory(prefix="reprokit-ddp-bench-") as tmp:
        argv = ["--nproc_per_node", str(nproc), "--master_addr",
                "127.0.0.1", "--master_port", str(_free_port()), __file__, "--out", str(Path(tmp) / "repros"),
                "--report", tmp, "--block", str(args.block), "--rounds", str(args.rounds),
                "--variants", args.variants, "--loops", args.loops, "--loop-block", str(args.loop_block),
                "--loop-rounds", str(args.loop_rounds)] + (["--quick"] if args.quick else [])
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = _torchrun(argv, env, forked=args.quick)
        ranks = []
        for r in range(nproc):
            p = Path(tmp) / f"rank{r}.json"
            if not p.exists():
                raise SystemExit(f"rank {r} wrote no report (torchrun exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            ranks.append(json.loads(p.read_text()))
    report = {"benchmark": "ddp_overhead", "commit": _commit(), "device": ranks[0]["device"], "torch": torch.__version__,
              "world_size": nproc, "config": ranks[0]["config"], "ranks": ranks,
              "ratio_recorder": max(r["variants"]["recorder"]["ratio"] for r in ranks),
              "ratio_aa": max(r["variants"]["bare (A/A)"]["ratio"] for r in ranks),
              "ratio_loops": {name: max(r["loop_shapes"][name]["ratio"] for r in ranks)
                              for name in ranks[0]["loop_shapes"]}}
    if args.save:
        name = "cpu" if report["device"] == "cpu" else report["device"].split()[1].lower()
        path = Path(args.save) / f"ddp_overhead-{name}x{nproc}-{report['commit']}.json"
        path.write_text(json.dumps(report, indent=1))
    if args.json:
        print(json.dumps(report, indent=1))
        return
    cfg = report["config"]
    print(f"device {report['device']} x{nproc}, torch {report['torch']}, commit {report['commit']}, batch "
          f"{cfg['batch']}x{cfg['ctx']} per rank, {cfg['layers']} layers d={cfg['d']}")
    print(f"{'rank':>4} {'variant':<24}{'mean ms':>10}{'median ms':>11}{'x bare':>8}{'95% CI (paired rounds)':>24}")
    for r in ranks:
        for name, v in r["variants"].items():
            ci = "[{:.3f}, {:.3f}]".format(*v["ratio_ci95"]) if "ratio_ci95" in v else ""
            print(f"{r['rank']:>4} {name:<24}{v['mean_ms']:>10.2f}{v['median_ms']:>11.2f}{v['ratio']:>8.3f}{ci:>24}")
    if report["ratio_loops"]:
        print("loop shapes (one synchronize per block, the loss read every N steps):")
        print(f"{'rank':>4} {'loop':<36}{'bare ms':>10}{'rec. ms':>11}{'x bare':>8}{'95% CI (paired rounds)':>24}")
        for r in ranks:
            for name, shape in r["loop_shapes"].items():
                for label, v in ((name, shape), *((f"{name} {n}", x) for n, x in shape.get("variants", {}).items())):
                    ci = "[{:.3f}, {:.3f}]".format(*v["ratio_ci95"]) if "ratio_ci95" in v else ""
                    print(f"{r['rank']:>4} {label:<36}{v['bare_ms']:>10.2f}{v['recorder_ms']:>11.2f}{v['ratio']:>8.3f}"
                          f"{ci:>24}")
    for r in ranks:
        dump = f"{r['dump_s']:.2f} s" if r["dump_s"] is not None else "no bundle"
        print(f"rank {r['rank']}: failure {r['failure']}, own window written in {dump} "
              f"({r['bundle_bytes'] / 1e6:.1f} MB); the failing step took {r['incident_step_s']:.2f} s in all")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
