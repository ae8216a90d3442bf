"""How long does each ``reprokit`` command take on a real GPT-2-124M failure, typed as a user would?

    python bench/cli_gpt2.py --save bench/results/cli_gpt2-<device>-<commit>.json   # GPU: GPT-2 124M
    python bench/cli_gpt2.py --quick --json                                        # CPU smoke run

The figures a user sees through the public CLI: a real GPT-2-124M run (bench/gpt.py, fused AdamW; a smaller GPT
without a GPU) recorded by a ``Recorder`` until step ``--fail-at`` returns a NaN loss, then every command as a user
types it, each in a fresh process, with the bundle's (and archive's) pages dropped from the page cache first.

Limits from the same run, on the same folder: the disk's sequential write and read (dd-style, fsync, pages
dropped) and sha256 on all cores. The bundle's write is compared with the disk write (the failing step's time less
a training step), ``verify`` with min(sha256 on all cores, disk read), ``pack`` with the copy rate
1/(1/read + 1/write).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from io_bench import _commit, disk_read, disk_write, drop_cache, files_under, save_and_print, sha256_rate
from replay_start import CPU, QUICK, record

from gpt import GPT2

COMMANDS: list[tuple[str, list[str], int]] = [
    # (name, arguments after `python -m reprokit`; {B} the bundle, {A} the archive; the exit code expected)
    ("--help", ["--help"], 0),
    ("--version", ["--version"], 0),
    ("inspect", ["inspect", "{B}"], 0),
    ("verify", ["verify", "{B}"], 0),
    ("replay", ["replay", "{B}", "--trust"], 1),
    ("replay --times 2", ["replay", "{B}", "--trust", "--times", "2"], 1),
    ("pack", ["pack", "{B}", "-o", "{A}"], 0),
    ("verify archive", ["verify", "{A}"], 0),
    ("replay archive", ["replay", "{A}", "--trust"], 1),
]
"""Every command a colleague runs on a bundle, in the order they would; replay exits 1 while the failure reproduces."""


def timed(argv: list[str], paths: list[Path], expect: int) -> float:
    """Seconds for ``python -m reprokit ARGV`` in a fresh process, the pages of ``paths`` dropped first."""
    drop_cache([p for path in paths if path.exists() for p in files_under(path)])
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "reprokit", *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != expect:
        raise SystemExit(f"`reprokit {' '.join(argv)}` exited {proc.returncode}, expected {expect}:\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return seconds


def size(path: Path) -> int:
    return sum(p.stat().st_size for p in files_under(path))


def run(args: argparse.Namespace) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not args.quick
    cfg = {**(QUICK if args.quick else GPT2 if cuda else CPU), "device": "cuda" if cuda else "cpu"}
    fail_at = 4 if args.quick else args.fail_at
    with tempfile.TemporaryDirectory(prefix="reprokit-cli-bench-", dir=args.dir) as tmp:
        rec = record(cfg, Path(tmp) / "out", fail_at, snapshot_every=3 if args.quick else args.snapshot_every)
        bundle, archive = Path(rec["bundle"]), Path(tmp) / "incident.tar"
        bundle_bytes = size(bundle)
        probe = Path(tmp) / "dd.bin"
        write_Bps = disk_write(probe, bundle_bytes)
        drop_cache([probe])
        read_Bps = disk_read(probe)
        probe.unlink()
        cores = os.cpu_count() or 1
        sha_Bps = sha256_rate(cores, max(bundle_bytes // cores, 64 << 20))
        seconds: dict[str, float] = {}
        for name, argv, expect in COMMANDS:
            argv = [a.format(B=bundle, A=archive) for a in argv]
            seconds[name] = timed(argv, [bundle, archive], expect)
        archive_bytes = archive.stat().st_size
    write_s = rec["failing_step_s"] - rec["train_step_ms"] / 1e3
    copy_Bps = 1 / (1 / read_Bps + 1 / write_Bps)
    return {"benchmark": "cli_gpt2", "commit": _commit(), "torch": torch.__version__,
            "python": platform.python_version(), "cores": cores,
            "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.machine()})", "config": cfg,
            "window_steps": rec["window_steps"], "train_step_ms": rec["train_step_ms"],
            "bundle_bytes": bundle_bytes, "archive_bytes": archive_bytes,
            "limits": {"disk_write_Bps": write_Bps, "disk_read_Bps": read_Bps, "sha256_all_cores_Bps": sha_Bps,
                       "copy_Bps": copy_Bps},
            "bundle_write_s": write_s, "seconds": seconds,
            "ratios": {"bundle_write_over_disk_write": bundle_bytes / write_s / write_Bps,
                       "verify_over_min_sha256_disk_read": bundle_bytes / seconds["verify"] / min(sha_Bps, read_Bps),
                       "pack_over_copy": bundle_bytes / seconds["pack"] / copy_Bps}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fail-at", type=int, default=60, help="the step whose batch makes the loss NaN")
    ap.add_argument("--snapshot-every", type=int, default=50)
    ap.add_argument("--dir", type=Path, default=None, help="folder on the disk to use (default: temp dir)")
    ap.add_argument("--quick", action="store_true", help="tiny GPT on the CPU (smoke run; figures meaningless)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON result here")
    args = ap.parse_args()
    res = run(args)
    if save_and_print(res, args.save, args.json):
        return
    gb, lim = 1e9, res["limits"]
    print(f"{res['device']}, commit {res['commit']}: bundle {res['bundle_bytes'] / gb:.2f} GB (a window of "
          f"{res['window_steps']} steps), archive {res['archive_bytes'] / gb:.2f} GB; training step "
          f"{res['train_step_ms']:.1f} ms")
    print(f"limits: disk write {lim['disk_write_Bps'] / gb:.2f} GB/s, read {lim['disk_read_Bps'] / gb:.2f} GB/s, "
          f"sha256 {lim['sha256_all_cores_Bps'] / gb:.2f} GB/s on {res['cores']} cores")
    print(f"{'bundle write (in the failing step)':36} {res['bundle_write_s']:7.2f} s")
    for name, s in res["seconds"].items():
        print(f"reprokit {name:27} {s:7.2f} s")
    r = res["ratios"]
    print(f"bundle write / disk write {r['bundle_write_over_disk_write']:.2f}; verify / min(sha256, disk read) "
          f"{r['verify_over_min_sha256_disk_read']:.2f}; pack / copy {r['pack_over_copy']:.2f}")


if __name__ == "__main__":
    main()
