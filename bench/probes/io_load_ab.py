"""Load of one safetensors state file, old path against new, interleaved in one process (issue 17).

    python bench/probes/io_load_ab.py [--gb 0.8] [--rounds 3]

old: hash the file (1 MiB reads), ``read_bytes``, ``safetensors.torch.load`` (what ``open_bundle`` +
``Bundle.state()`` did before); new: ``reprokit.bundle.tensorfile.read_verified`` (one read into one
buffer, hashed on the way, tensors as views). Page-cache pages are dropped before each load.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load as st_load

from reprokit.bundle import tensorfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=0.8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "state.safetensors"
        n = max(1, int(args.gb * 1e9 / 4 / (1 << 22)))
        sha, size = tensorfile.write_safetensors(p, {f"w{i}": torch.randn(1 << 22) for i in range(n)})

        def drop() -> None:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)

        def old() -> object:
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            assert h.hexdigest() == sha
            return st_load(p.read_bytes())

        def new() -> object:
            return tensorfile.read_verified(p, sha, size)

        res: dict[str, list[float]] = {"old": [], "new": []}
        for i in range(args.rounds):
            for name, fn in ((("old", old), ("new", new)) if i % 2 == 0 else (("new", new), ("old", old))):
                drop()
                t0 = time.perf_counter()
                x = fn()
                res[name].append(time.perf_counter() - t0)
                del x
        print(f"{size / 1e9:.2f} GB:", {k: [round(v, 2) for v in vs] for k, vs in res.items()})


if __name__ == "__main__":
    main()
