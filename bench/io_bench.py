"""Bundle I/O against the hardware limits measured in the same run.

    python bench/io_bench.py                 # a GPT-2-124M-sized state (params + AdamW moments, ~1.5 GB)
    python bench/io_bench.py --size-gb 30    # a state of ~30 GB (the GPU machine's run)
    python bench/io_bench.py --quick --json  # smoke run for the test suite (timings meaningless)
    python bench/io_bench.py --dir /nvme/tmp # measure another disk (default: a temp dir)

Limits, measured first in the same process on the same folder:
- disk write: ``dd``-style sequential write of as many bytes as the state, 16 MiB writes, fsync;
- disk read: the same file read back in 16 MiB ``readinto`` calls after its pages were dropped
  from the page cache with ``posix_fadvise(DONTNEED)`` (works without root for files we wrote;
  the JSON says whether it was available). Every read phase below drops the bundle's pages the
  same way first, so reads come from the disk, not from memory;
- sha256: ``hashlib`` over 64 MiB buffers on one core, and on every core at once (threads:
  hashlib releases the GIL).

Figures (each printed as a ratio to its limit, with the raw rates beside it):
1. dump: ``write_bundle`` of the state (what the recorder does at a failure), vs disk write;
2. load: ``open_bundle`` + ``Bundle.state()`` (checksums verified), vs disk read;
3. inspect: ``reprokit inspect --json`` as a command (seconds; the goal is <= 1 s whatever the size);
4. verify: ``reprokit.verify`` of the bundle, vs min(sha256 on every core, disk read);
5. pack and open: ``reprokit pack`` and opening the archive (``archive.extracted``), vs the copy
   rate 1 / (1/read + 1/write) (both read the source and write the result on the same disk); both
   containers, a plain ``.tar`` (pack, open_archive) and a ``.tar.gz`` (pack_gz, open_archive_gz),
   side by side, alternating, best of two: ``pack_gz_over_pack`` is the compressed pack's rate over the plain
   one's (target >= 0.5);
6. start-up: ``reprokit --help`` / ``--version`` wall time next to ``python -c pass``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
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
from reprokit import bundle as B
from reprokit.archive import extracted
from reprokit.pack import pack

MiB = 1 << 20
CHUNK = 16 * MiB
GPT2 = {"vocab": 50257, "ctx": 1024, "d": 768, "layers": 12}


def gpt2_shapes(scale: float = 1.0) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of GPT-2 124M (``scale`` < 1 shrinks the vocabulary and layers, > 1 repeats layers)."""
    d, vocab, ctx = GPT2["d"], GPT2["vocab"], GPT2["ctx"]
    layers = GPT2["layers"]
    if scale < 1:
        vocab, ctx, layers = max(64, int(vocab * scale)), max(16, int(ctx * scale)), max(1, int(layers * scale))
        d = max(64, int(d * scale ** 0.5))
    else:
        layers = max(1, round(layers * scale))
    shapes: dict[str, tuple[int, ...]] = {"wte": (vocab, d), "wpe": (ctx, d), "ln_f.w": (d,), "ln_f.b": (d,)}
    for i in range(layers):
        p = f"h.{i:03d}."
        shapes |= {p + "ln_1.w": (d,), p + "ln_1.b": (d,), p + "attn.c_attn.w": (d, 3 * d), p + "attn.c_attn.b": (3 * d,),
                   p + "attn.c_proj.w": (d, d), p + "attn.c_proj.b": (d,), p + "ln_2.w": (d,), p + "ln_2.b": (d,),
                   p + "mlp.c_fc.w": (d, 4 * d), p + "mlp.c_fc.b": (4 * d,), p + "mlp.c_proj.w": (4 * d, d),
                   p + "mlp.c_proj.b": (d,)}
    return shapes


class Synthetic(nn.Module):
    """GPT-2-shaped parameters; the forward is never run (the bench measures I/O, not compute)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.params = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes.values()])


def build(config: dict[str, Any]) -> reprokit.TrainState:
    """The model with AdamW's moments filled (random: floats that do not compress), as after a real step."""
    model = Synthetic(gpt2_shapes(config["scale"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return reprokit.TrainState(model=model, optimizer=opt)


def train_step(state: reprokit.TrainState, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """No compute: step 1 returns a NaN loss, so the recorder dumps its window (state at step 0)."""
    return batch["x"].sum() * (float("nan") if batch["fail"].item() else 0.0)


def scale_for(target_bytes: int | None, quick: bool) -> float:
    if quick:
        return 0.01
    base = sum(_numel(s) for s in gpt2_shapes().values()) * 4 * 3
    return 1.0 if target_bytes is None else target_bytes / base


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --- limits -----------------------------------------------------------------------------

def drop_cache(paths: list[Path]) -> bool:
    """Drop the page-cache pages of these files (no root needed); False where the OS cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def files_under(path: Path) -> list[Path]:
    return [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]


def disk_write(path: Path, nbytes: int) -> float:
    buf = os.urandom(CHUNK)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(buf[:min(left, CHUNK)])
        f.flush()
        os.fsync(f.fileno())
    return nbytes / (time.perf_counter() - t0)


def disk_read(path: Path) -> float:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    t0 = time.perf_counter()
    n = 0
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(view):
            n += k
    return n / (time.perf_counter() - t0)


def sha256_rate(threads: int, per_thread: int) -> float:
    data = os.urandom(64 * MiB)

    def work() -> None:
        h = hashlib.sha256()
        for _ in range(max(1, per_thread // len(data))):
            h.update(data)

    ts = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return threads * max(1, per_thread // len(data)) * len(data) / (time.perf_counter() - t0)


def cmd_seconds(args: list[str], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(args, check=True, capture_output=True)
        best = min(best, time.perf_counter() - t0)
    return best


# --- the figures ------------------------------------------------------------------------

def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="io-bench-", dir=args.dir))
    try:
        return _run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    target = int(args.size_gb * (1 << 30)) if args.size_gb else None
    config = {"scale": scale_for(target, args.quick)}
    state = build(config)
    state_bytes = sum(3 * p.numel() * p.element_size() for p in state.model.parameters())
    n_tensors = 3 * len(list(state.model.parameters()))
    cores = os.cpu_count() or 1
    res: dict[str, Any] = {"commit": _commit(), "device": _device(), "torch": torch.__version__, "cores": cores,
                           "python": platform.python_version(), "dir": str(args.dir or tempfile.gettempdir()),
                           "state_bytes": state_bytes, "tensors": n_tensors}
    probe = root / "dd.bin"
    w = disk_write(probe, state_bytes)
    res["page_cache_dropped"] = drop_cache([probe])
    r = disk_read(probe)
    probe.unlink()
    sha1 = sha256_rate(1, min(state_bytes, 512 * MiB))
    shan = sha256_rate(cores, min(state_bytes, 512 * MiB))
    copy = 1 / (1 / r + 1 / w)
    res["limits"] = {"disk_write_Bps": w, "disk_read_Bps": r, "sha256_1core_Bps": sha1, "sha256_all_cores_Bps": shan,
                     "copy_Bps": copy}

    def figure(name: str, nbytes: int, seconds: float, limit: float, limit_name: str, **extra: Any) -> None:
        rate = nbytes / seconds
        res["figures"][name] = {"bytes": nbytes, "seconds": seconds, "Bps": rate, "limit": limit_name,
                                "limit_Bps": limit, "ratio": rate / limit, **extra}

    res["figures"] = {}
    path, dump_s = _dump(root / "out", state, config)
    bundle_bytes = sum(p.stat().st_size for p in files_under(path))
    figure("dump", bundle_bytes, dump_s, w, "disk_write")
    del state

    drop_cache(files_under(path))
    t0 = time.perf_counter()
    b = B.open_bundle(path)
    opened = time.perf_counter() - t0
    _, loaded = b.state()
    seconds = time.perf_counter() - t0
    # One file's sha256 is one sequential stream: it cannot beat one core, whatever the disk.
    figure("load", bundle_bytes, seconds, r, "disk_read", open_bundle_s=opened,
           ratio_to_min_read_sha1core=bundle_bytes / seconds / min(r, sha1))
    del loaded

    drop_cache(files_under(path))
    t0 = time.perf_counter()
    problems = B.verify(path)
    assert not problems, problems
    seconds = time.perf_counter() - t0
    figure("verify", bundle_bytes, seconds, min(shan, r), "min(sha256_all_cores, disk_read)",
           ratio_to_min_read_sha1core=bundle_bytes / seconds / min(r, sha1))

    drop_cache(files_under(path))
    cli = [sys.executable, "-m", "reprokit"]
    t0 = time.perf_counter()
    out = subprocess.run([*cli, "inspect", str(path), "--json"], capture_output=True, text=True)
    res["inspect_cli_seconds"] = time.perf_counter() - t0
    res["inspect_exit"] = out.returncode

    best: dict[str, float] = {}
    for _ in range(1 if args.quick else 2):  # plain, compressed, plain, compressed: the best of each, from a cold cache
        for suffix, key in ((".tar", ""), (".tar.gz", "_gz")):
            drop_cache(files_under(path))
            t0 = time.perf_counter()
            packed = pack(path, root / f"repro{suffix}")
            best["pack" + key] = min(best.get("pack" + key, float("inf")), time.perf_counter() - t0)
            res["archive" + key] = {"name": packed.output.name, "bytes": packed.size}

            drop_cache([packed.output])
            t0 = time.perf_counter()
            with extracted(packed.output) as d:
                opened_s = time.perf_counter() - t0
                assert (d / B.MANIFEST).is_file()
            best["open_archive" + key] = min(best.get("open_archive" + key, float("inf")), opened_s)
            packed.output.unlink()
    for name, seconds in best.items():
        figure(name, bundle_bytes, seconds, copy, "copy (1/(1/read+1/write))")
    res["pack_gz_over_pack"] = res["figures"]["pack_gz"]["Bps"] / res["figures"]["pack"]["Bps"]

    n = 1 if args.quick else 5  # best of n
    bare = cmd_seconds([sys.executable, "-c", "pass"], n)
    res["startup"] = {"python_bare_s": bare, "help_s": cmd_seconds([*cli, "--help"], n),
                      "version_s": cmd_seconds([*cli, "--version"], n)}
    return res


def _dump(out: Path, state: reprokit.TrainState, config: dict[str, Any]) -> tuple[Path, float]:
    """Record step 0, fail at step 1: the failing ``rec.step`` is the dump (the step itself does nothing)."""
    rec = reprokit.Recorder(state, train_step, build=build, config=config, out_dir=out, check_grads=False)
    x = torch.ones(4, 8)
    rec.step({"x": x, "fail": torch.tensor(False)})
    t0 = time.perf_counter()
    try:
        rec.step({"x": x, "fail": torch.tensor(True)})
    except reprokit.TrainingFailure as e:
        return Path(e.bundle), time.perf_counter() - t0
    raise AssertionError("the NaN loss was not detected")


def save_and_print(res: dict[str, Any], save: Path | None, as_json: bool) -> bool:
    """Write ``res`` to ``save`` (when given) and print it as JSON when asked; True when the caller prints nothing else."""
    if save:
        save.parent.mkdir(parents=True, exist_ok=True)
        save.write_text(json.dumps(res, indent=1) + "\n")
    if as_json:
        print(json.dumps(res))
    return as_json


def _commit() -> str:
    """The checkout's commit; ``$BENCH_COMMIT`` where the copy that runs has no (or a stale) git history."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _device() -> str:
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores; {platform.processor() or platform.system()})"


def _fmt(res: dict[str, Any]) -> str:
    gb = 1e9
    lim = res["limits"]
    lines = [f"state {res['state_bytes'] / gb:.2f} GB in {res['tensors']} tensors; commit {res['commit']}, "
             f"{res['device']}; page cache dropped per file: {res['page_cache_dropped']}",
             f"limits: disk write {lim['disk_write_Bps'] / gb:.2f} GB/s, read {lim['disk_read_Bps'] / gb:.2f} GB/s, "
             f"sha256 {lim['sha256_1core_Bps'] / gb:.2f} GB/s (1 core), {lim['sha256_all_cores_Bps'] / gb:.2f} GB/s "
             f"({res['cores']} cores), copy {lim['copy_Bps'] / gb:.2f} GB/s",
             f"{'figure':14} {'seconds':>8} {'GB/s':>7} {'limit GB/s':>10} {'ratio':>6}  limit"]
    for name, f in res["figures"].items():
        lines.append(f"{name:14} {f['seconds']:8.2f} {f['Bps'] / gb:7.2f} {f['limit_Bps'] / gb:10.2f} "
                     f"{f['ratio']:6.2f}  {f['limit']}")
    s = res["startup"]
    lines.append("single-stream ceiling min(disk read, sha256 1 core): " + ", ".join(
        f"{k} {f['ratio_to_min_read_sha1core']:.2f}" for k, f in res["figures"].items()
        if "ratio_to_min_read_sha1core" in f) + f"; open_bundle {res['figures']['load']['open_bundle_s']:.2f} s")
    lines.append(f"inspect (CLI) {res['inspect_cli_seconds']:.2f} s")
    fig, a, z = res["figures"], res["archive"], res["archive_gz"]
    lines.append(f"pack {a['name']} {fig['pack']['Bps'] / 1e6:.0f} MB/s, {z['name']} {fig['pack_gz']['Bps'] / 1e6:.0f} "
                 f"MB/s: compressed/plain {res['pack_gz_over_pack']:.2f}; open {fig['open_archive']['Bps'] / 1e6:.0f} "
                 f"vs {fig['open_archive_gz']['Bps'] / 1e6:.0f} MB/s; sizes {a['bytes'] / gb:.3f} GB vs "
                 f"{z['bytes'] / gb:.3f} GB ({z['bytes'] / a['bytes']:.3f}x)")
    lines.append(f"start-up: --help {s['help_s']:.2f} s, --version {s['version_s']:.2f} s, "
                 f"python -c pass {s['python_bare_s']:.2f} s")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few MB (smoke run; timings meaningless)")
    ap.add_argument("--size-gb", type=float, default=None, help="state size in GB (default: GPT-2 124M + AdamW)")
    ap.add_argument("--dir", type=Path, default=None, help="folder on the disk to measure (default: temp dir)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--save", type=Path, default=None, help="also write the JSON result here")
    args = ap.parse_args()
    res = run(args)
    if not save_and_print(res, args.save, args.json):
        print(_fmt(res))


if __name__ == "__main__":
    main()
