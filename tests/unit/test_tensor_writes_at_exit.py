"""Tensor files written at interpreter exit: the incident watcher finishes a peer's window then
(reprokit.distributed.IncidentBoard.finish), when concurrent.futures takes no new work (and Python 3.12+ starts no
thread). A piece of 1 MiB or more was hashed on a pool thread, so every real model's window failed to write at exit
("cannot schedule new futures after interpreter shutdown"); only tiny test models got through."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import atexit, sys
    from pathlib import Path

    import torch

    from reprokit.bundle import tensorfile
    from reprokit.bundle import BundleWriter

    out = Path(sys.argv[1])

    def at_exit():
        torch.manual_seed(0)
        big = {"w": torch.randn(1 << 19), "v": torch.randn(1 << 19)}  # 2 MiB each: hashed beside the write
        sha, size = tensorfile.write_safetensors(out / "one.safetensors", big)
        print("one", sha, size, flush=True)
        tensorfile.SHARD_BYTES = 1 << 20  # two shards: written several at once
        w = BundleWriter(out, "bundle-x")
        w.write_state(big)
        for rel, entry in sorted(w.files.items()):
            print("state", w.tmp / rel, entry["sha256"], entry["size"], flush=True)

    atexit.register(at_exit)
""")


@pytest.mark.slow
def test_tensor_files_are_written_from_an_atexit_hook(tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line.split() for line in proc.stdout.splitlines()]
    files = [(tmp_path / "one.safetensors", *line[1:]) for line in lines if line[0] == "one"]
    files += [(Path(line[1]), *line[2:]) for line in lines if line[0] == "state"]
    assert len(files) == 3, proc.stdout  # one file, then the state's two shards
    torch.manual_seed(0)
    want = {"w": torch.randn(1 << 19), "v": torch.randn(1 << 19)}
    got: dict[str, torch.Tensor] = {}
    for path, sha, size in files:
        data = path.read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (sha, int(size)), path
        if path.name != "one.safetensors":
            got.update(load_file(path))
        else:
            assert all(torch.equal(t, want[k]) for k, t in load_file(path).items())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
