"""How soon after the load does a replay's first step start, against a training step?

    python bench/replay_start.py --save bench/results/replay_start-<device>-<commit>.json   # GPU: GPT-2 124M
    python bench/replay_start.py --quick --json                                            # CPU smoke run

A real GPT-2-124M run (bench/gpt.py, fused AdamW on a GPU; a smaller GPT on a CPU) is recorded until step
``--fail-at`` returns a NaN loss (its batch carries the poison, so replay sees it too); the training steps' median
is the reference. Then a fresh
process (replay is what a colleague runs, with nothing warm) replays the bundle through ``reprokit.replayer``'s own
session, phase by phase, with the bundle's pages dropped from the page cache first:

- load: open the bundle, ``build(config)``, read and verify the state (``Session.__enter__``; on a GPU this
  includes copying the state to the device as each file is verified);
- to the first step: put the state, RNG and detector back (``Session.restore``) and read the window's batches;
- the first replayed step, and the median of the others (each step timed to its loss read).

The replay runs twice, each in its own fresh process: as ``reprokit replay`` does, and with ``preload=False`` (the
state copied to the GPU by the first restore, after the load), the side-by-side reference.

The goal: the first replayed step starts within 2x a training step after the load. The first step itself is
compared with the training run's first step (in its fresh process: CUDA loads kernels on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from io_bench import _commit, disk_read, disk_write, drop_cache, files_under, save_and_print
from recorder_overhead import make_batch

import reprokit
from reprokit.bundle import open_bundle
from reprokit.replayer import Session

from gpt import GPT, GPT2
from gpt import train_step as gpt_step

QUICK = {"layers": 2, "d": 64, "heads": 4, "vocab": 256, "ctx": 32, "batch": 2}
CPU = {"layers": 6, "d": 384, "heads": 6, "vocab": 50304, "ctx": 256, "batch": 4}
"""Without a GPU: a smaller GPT (GPT-2's vocabulary, half its width and layers), so that a CPU run takes minutes."""


def build(config: dict[str, Any]) -> reprokit.TrainState:
    torch.manual_seed(0)
    if config["device"] == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    model = GPT(config["layers"], config["d"], config["heads"], config["vocab"], config["ctx"]).to(config["device"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=config["device"] == "cuda")
    return reprokit.TrainState(model=model, optimizer=opt)


def train_step(state: reprokit.TrainState, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The GPT step; a batch whose ``poison`` is set makes the loss NaN (recorded with the batch, so it replays)."""
    targets = torch.full_like(batch["targets"], -100) if bool(batch["poison"]) else batch["targets"]  # no target: 0/0
    return gpt_step(state, {"idx": batch["idx"], "targets": targets})


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def record(cfg: dict[str, Any], out: Path, fail_at: int, snapshot_every: int) -> dict[str, Any]:
    state = build(cfg)
    g = torch.Generator(device=cfg["device"]).manual_seed(0)
    rec = reprokit.Recorder(state, train_step, build=build, config=cfg, out_dir=out, snapshot_every=snapshot_every)
    times = []
    try:
        for i in range(fail_at + 1):
            batch = {**make_batch(cfg, g), "poison": torch.tensor(i == fail_at)}
            sync(cfg["device"])
            t0 = time.perf_counter()
            rec.step(batch).item()
            times.append(time.perf_counter() - t0)
    except reprokit.TrainingFailure as e:
        failing_step_s = time.perf_counter() - t0  # the step, its loss read and the bundle's write
        bundle = e.bundle
    else:
        raise SystemExit("the poisoned step did not fail")
    finally:
        rec.close()
    assert bundle is not None, "the failure wrote no bundle"
    # The steps after the first snapshot and before the failing one: ordinary training steps.
    ordinary = times[1:-1] or times
    return {"bundle": str(bundle), "train_step_ms": statistics.median(ordinary) * 1e3,
            "train_first_step_ms": times[0] * 1e3, "failing_step_s": failing_step_s,
            "window_steps": len(open_bundle(bundle).steps)}


def replay_phases(bundle: str, device: str, preload: bool) -> dict[str, Any]:
    """Run in a fresh process: the replay's phases, timed."""
    dropped = drop_cache(files_under(Path(bundle)))
    t0 = time.perf_counter()
    b = open_bundle(bundle)
    read_s = []
    state = b.state

    def timed_state(*a: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return state(*a, **kw)
        finally:
            read_s.append(time.perf_counter() - t)

    b.state = timed_state  # type: ignore[method-assign]
    with Session(b, device=device, preload=preload) as s:
        sync(device)
        t_load = time.perf_counter()
        s.restore()
        sync(device)
        t_restored = time.perf_counter()
        inputs = s.inputs()
        sync(device)
        t_ready = time.perf_counter()
        steps_ms = []
        outcome = None
        for inp in inputs:
            t = time.perf_counter()
            outcome = s.run([inp], restore=False)
            sync(device)
            steps_ms.append((time.perf_counter() - t) * 1e3)
            if outcome.failure is not None:
                break
    assert outcome is not None
    return {"load_s": t_load - t0, "state_read_s": read_s[0], "to_first_step_s": t_ready - t_load,
            "restore_ms": (t_restored - t_load) * 1e3,
            "inputs_ms": (t_ready - t_restored) * 1e3, "first_step_ms": steps_ms[0],
            "other_steps_ms_median": statistics.median(steps_ms[1:]) if len(steps_ms) > 1 else None,
            "steps_replayed": len(steps_ms), "reproduced": outcome.same, "pages_dropped": dropped}


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not args.quick
    cfg = {**(QUICK if args.quick else GPT2 if cuda else CPU), "device": "cuda" if cuda else "cpu"}
    fail_at = 4 if args.quick else args.fail_at
    with tempfile.TemporaryDirectory(prefix="reprokit-replay-start-") as tmp:
        rec = record(cfg, Path(tmp), fail_at, snapshot_every=3 if args.quick else args.snapshot_every)
        state_bytes = sum(p.stat().st_size for p in files_under(Path(rec["bundle"]) / "state"))
        probe = Path(tmp) / "dd.bin"  # the disk's sequential read on the same folder, dd-style, pages dropped
        disk_write(probe, state_bytes)
        drop_cache([probe])
        read_Bps = disk_read(probe)
        probe.unlink()
        runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
        for _ in range(args.repeat):  # interleaved: each process starts as cold as the one before it
            for preload in ("on", "off"):
                proc = subprocess.run([sys.executable, __file__, "--phase", rec["bundle"], "--device", cfg["device"],
                                       "--preload", preload], capture_output=True, text=True)
                if proc.returncode:
                    raise SystemExit(f"the replay process failed:\n{proc.stderr[-3000:]}")
                runs[preload].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    train = rec["train_step_ms"]

    def median_run(rs: list[dict[str, Any]]) -> dict[str, Any]:
        """Each figure's median over the repeats (the first process's figures when there is one)."""
        out = dict(rs[0])
        for k, v in rs[0].items():
            if isinstance(v, float):
                out[k] = statistics.median(r[k] for r in rs)
        out["repeats"] = {k: [r[k] for r in rs] for k in ("load_s", "state_read_s", "to_first_step_s")}
        return out

    rep, ref = median_run(runs["on"]), median_run(runs["off"])

    def ratios(r: dict[str, Any]) -> dict[str, Any]:
        return {**r, "state_read_over_disk_read": state_bytes / r["state_read_s"] / read_Bps,
                "to_first_step_over_train_step": r["to_first_step_s"] * 1e3 / train,
                "first_step_over_train_step": r["first_step_ms"] / train,
                "first_step_over_train_first_step": r["first_step_ms"] / rec["train_first_step_ms"]}

    return {"benchmark": "replay_start", "commit": _commit(), "torch": torch.__version__,
            "python": platform.python_version(), "cores": os.cpu_count(),
            "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()})", "config": cfg,
            "window_steps": rec["window_steps"], "train_step_ms": train, "state_bytes": state_bytes,
            "disk_read_Bps": read_Bps,
            "train_first_step_ms": rec["train_first_step_ms"], **ratios(rep), "without_preload": ratios(ref)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fail-at", type=int, default=60, help="the step whose batch makes the loss NaN")
    ap.add_argument("--snapshot-every", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="tiny GPT on the CPU (smoke run; figures meaningless)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="replay processes per variant (figures: medians; default 3, 1 with --quick)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON result here")
    ap.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--preload", default="on", choices=["on", "off"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.repeat = args.repeat or (1 if args.quick else 3)
    if args.phase:
        print(json.dumps(replay_phases(args.phase, args.device, args.preload == "on")))
        return
    res = run(args)
    if save_and_print(res, args.save, args.json):
        return
    print(f"{res['device']}, commit {res['commit']}: a window of {res['window_steps']} steps, training step "
          f"{res['train_step_ms']:.1f} ms (median)")
    print(f"medians of {args.repeat} replay processes each, interleaved")
    for name, r in (("replay", res), ("preload=False", res["without_preload"])):
        print(f"{name}:")
        print(f"  load (open, build, read + verify the state)   {r['load_s']:.2f} s, of which the state "
              f"{r['state_read_s']:.2f} s = {r['state_read_over_disk_read']:.2f} x the disk's read of "
              f"{res['disk_read_Bps'] / 1e9:.2f} GB/s (pages dropped: {r['pages_dropped']})")
        print(f"  load -> first step starts                      {r['to_first_step_s'] * 1e3:.1f} ms = "
              f"{r['to_first_step_over_train_step']:.2f} x a training step (goal <= 2): restore "
              f"{r['restore_ms']:.1f} ms, batches {r['inputs_ms']:.1f} ms")
        others = r["other_steps_ms_median"]
        print(f"  first replayed step                            {r['first_step_ms']:.1f} ms = "
              f"{r['first_step_over_train_step']:.2f} x a training step, "
              f"{r['first_step_over_train_first_step']:.2f} x the training run's first step "
              f"({res['train_first_step_ms']:.1f} ms); the others "
              f"{'-' if others is None else f'{others:.1f}'} ms (median)")
        print(f"  reproduced: {r['reproduced']} after {r['steps_replayed']} steps")


if __name__ == "__main__":
    main()
