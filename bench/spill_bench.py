"""A state too large to hold twice: recorded through ``spill_dir`` and replayed, with peak host memory.

    python bench/spill_bench.py --size-gb 30 --save bench/results/spill_bench-h100-<commit>.json   # the GPU machine's run
    python bench/spill_bench.py --quick --json                                                     # smoke run (CPU, ~10 MB)

A stack of square ``Linear`` layers with AdamW (fused on CUDA) whose state (parameters + both moments) is
``--size-gb``. Each phase runs in its own process, so its peak resident memory (``ru_maxrss``) is its own
(with --quick, a process forked from the bench's, torch imported: no torch import each):

1. record: a real ``Recorder(spill_dir=...)`` with ``snapshot_every=2``; step 3 returns a NaN loss, so the
   snapshot of step 2 (parameters and moments) is the bundle's state. Reported: the spill's seconds and
   rate (a synchronous copy through a bounded pinned buffer into the bundle's part files, several written at
   once), the failing step's seconds (the dump links the spilled parts into the bundle), peak RSS before
   the recorder existed and at the end, and the recorder's own held host memory.
2. replay: ``reprokit.replay(bundle)`` on the same device: the state is read once (hashed on the way) into
   host memory and copied into the model. Reported: its seconds and peak RSS against the state's size.

Disk limits (write with fsync, read after dropping the pages) come from ``io_bench`` in the same run, on a
file of min(state, 4 GiB).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import reprokit

sys.path.insert(0, str(Path(__file__).parent))
from io_bench import _commit, disk_read, disk_write, drop_cache, files_under, save_and_print  # noqa: E402

GiB = 1 << 30


def layout(size_gb: float, quick: bool) -> tuple[int, int]:
    """(width, layers) of a stack whose state (3 fp32 copies of the parameters) is about ``size_gb``."""
    if quick:
        return 64, 200
    d = 8192
    return d, max(1, math.ceil(size_gb * GiB / (3 * 4 * d * d)))


def build(config: dict[str, Any]) -> reprokit.TrainState:
    torch.manual_seed(0)
    device = torch.device(config["device"])
    model = nn.Sequential(*[nn.Linear(config["d"], config["d"], bias=False, device=device)
                            for _ in range(config["layers"])])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    return reprokit.TrainState(model=model, optimizer=opt)


def train_step(state: reprokit.TrainState, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss = state.model(batch["x"]).float().pow(2).mean() * batch["scale"]
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def phase_record(root: Path, config: dict[str, Any]) -> dict[str, Any]:
    state = build(config)
    device = torch.device(config["device"])
    before = rss()
    rec = reprokit.Recorder(state, train_step, build=build, config=config, out_dir=root / "out",
                            spill_dir=root / "spill", snapshot_every=2, check_grads=False)
    g = torch.Generator().manual_seed(1)
    out: dict[str, Any] = {"rss_before_recorder": before}
    for k in range(4):
        batch = {"x": torch.randn(8, config["d"], generator=g).to(device),
                 "scale": torch.tensor(float("nan") if k == 3 else 1.0, device=device)}
        t0 = time.perf_counter()
        try:
            rec.step(batch)
        except reprokit.TrainingFailure as e:
            out |= {"bundle": str(e.bundle), "failing_step_s": time.perf_counter() - t0}
            break
        if k == 2:
            out |= {"spill_s": rec.snapshot_stats["spill_seconds"], "state_bytes": rec.snapshot_stats["bytes"]}
    stats = rec.stats()
    rec.close()
    return out | {"peak_rss": peak_rss(), "recorder_peak_host_bytes": stats["peak_pinned_bytes"] + stats["peak_pageable_bytes"],
                  "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, type(None)))}}


def phase_replay(bundle: Path, device: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    report = reprokit.replay(bundle, device=device)
    return {"replay_s": time.perf_counter() - t0, "verdict": report.verdict, "peak_rss": peak_rss(),
            "bit_exact": report.fidelity.get("bit_exact")}


def phase(args: list[str]) -> dict[str, Any]:
    """``["--phase", "record", ROOT, CONFIG]`` or ``["--phase", "replay", BUNDLE, DEVICE]``."""
    if args[1] == "record":
        return phase_record(Path(args[2]), json.loads(args[3]))
    return phase_replay(Path(args[2]), args[3])


def child(args: list[str], quick: bool = False) -> dict[str, Any]:
    """The phase in a fresh process of its own. ``quick`` (a smoke run, figures meaningless): in a process forked
    from this one, which imported torch already, when this one has no other thread (else fresh, as always)."""
    if quick and threading.active_count() == 1:
        import traceback

        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(read)
                os.dup2(2, 1)  # what the phase prints goes with its errors, never into the bench's own output
                with os.fdopen(write, "w") as out:
                    out.write(json.dumps(phase(args)))
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as got:
            text = got.read()
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if status:
            raise SystemExit(f"phase {args[:2]} failed (exit {status}; its traceback is above)")
        return json.loads(text)
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"phase {args[:2]} failed:\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="spill-bench-", dir=args.dir))
    try:
        d, layers = layout(args.size_gb, args.quick)
        device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
        config = {"d": d, "layers": layers, "device": device}
        res: dict[str, Any] = {"commit": _commit(), "torch": torch.__version__, "python": platform.python_version(),
                               "device": torch.cuda.get_device_name() if device == "cuda" else f"cpu ({platform.machine()})",
                               "cores": os.cpu_count(), "config": config}
        probe = root / "dd.bin"
        nbytes = min(int(3 * 4 * d * d * layers), 4 * GiB)
        res["limits"] = {"disk_write_Bps": disk_write(probe, nbytes)}
        drop_cache([probe])
        res["limits"]["disk_read_Bps"] = disk_read(probe)
        probe.unlink()
        rec = res["record"] = child(["--phase", "record", str(root), json.dumps(config)], args.quick)
        bundle = Path(rec["bundle"])
        shutil.rmtree(root / "spill", ignore_errors=True)  # the bundle holds its own links to the parts
        drop_cache(files_under(bundle))
        rep = res["replay"] = child(["--phase", "replay", str(bundle), device], args.quick)
        state = rec["state_bytes"]
        res["summary"] = {
            "state_GB": state / 1e9,
            "spill_GBps": state / rec["spill_s"] / 1e9,
            "spill_vs_disk_write": state / rec["spill_s"] / res["limits"]["disk_write_Bps"],
            "dump_s": rec["failing_step_s"],
            "record_peak_rss_GB": rec["peak_rss"] / 1e9, "record_rss_before_recorder_GB": rec["rss_before_recorder"] / 1e9,
            "record_peak_over_state": rec["peak_rss"] / state,
            "recorder_peak_host_GB": rec["recorder_peak_host_bytes"] / 1e9,
            "replay_s": rep["replay_s"], "replay_peak_rss_GB": rep["peak_rss"] / 1e9,
            "replay_peak_over_state": rep["peak_rss"] / state, "verdict": rep["verdict"],
        }
        return res
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--phase":
        print(json.dumps(phase(sys.argv[1:])))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=30.0, help="state size (parameters + AdamW moments), GB")
    ap.add_argument("--quick", action="store_true", help="a ~10 MB state on CPU (smoke run; figures meaningless)")
    ap.add_argument("--dir", type=Path, default=None, help="folder on the disk to use (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON result here")
    args = ap.parse_args()
    res = run(args)
    if save_and_print(res, args.save, args.json):
        return
    s = res["summary"]
    print(f"{res['device']}, commit {res['commit']}: state {s['state_GB']:.2f} GB")
    print(f"  spill (synchronous snapshot to disk): {s['spill_GBps']:.2f} GB/s = {s['spill_vs_disk_write']:.2f} of disk write")
    print(f"  failing step (dump, parts linked): {s['dump_s']:.2f} s")
    print(f"  record peak RSS {s['record_peak_rss_GB']:.2f} GB ({s['record_peak_over_state']:.2f}x state; "
          f"{s['record_rss_before_recorder_GB']:.2f} GB before the recorder; the recorder's own peak "
          f"{s['recorder_peak_host_GB']:.2f} GB)")
    print(f"  replay {s['replay_s']:.1f} s, verdict {s['verdict']}, peak RSS {s['replay_peak_rss_GB']:.2f} GB "
          f"({s['replay_peak_over_state']:.2f}x state)")


if __name__ == "__main__":
    main()
