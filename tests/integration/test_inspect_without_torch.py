"""`reprokit inspect` answers without importing torch (<= 1 s whatever the state size).

Each case runs the CLI in a fresh interpreter and checks, after it printed, that neither torch nor
safetensors' torch backend was imported: a future module-level `import torch` on inspect's path
(bundle, report, diagnose, schema, or anything they import) fails here.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from rk_testing import bundle_of, record

from reprokit.cli import main
from reprokit.pack import pack

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "safetensors.torch")


def _run_inspect(*args: str) -> tuple[str, list[str]]:
    """``reprokit inspect ARGS`` in a fresh interpreter: (stdout, the heavy modules it imported)."""
    code = textwrap.dedent(f"""
        import sys
        from reprokit.cli import main
        try:
            main(["inspect", *{list(args)!r}])
        except SystemExit as e:
            assert e.code in (0, None), e.code
        sys.stdout.flush()
        print("LOADED", [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    loaded = proc.stderr.rsplit("LOADED ", 1)[1].strip()
    return proc.stdout, json.loads(loaded.replace("'", '"'))


def _lm_batches(lm, cfg, odd_leaves: bool):
    for s, b in enumerate(lm.batches(cfg, 6, oov_step=4)):
        if odd_leaves:  # leaves the step ignores: a dtype numpy lacks, and a numpy array
            b["weights"] = torch.ones(8, dtype=torch.bfloat16)
            b["np_w"] = np.ones((8, 2), dtype=np.float32)
            if s == 4:
                b["weights"][3] = float("nan")
                b["np_w"][1, 1] = np.inf
        yield b


@pytest.fixture(scope="module")
def oov_bundle(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tests" / "projects"))
    try:
        import rk_lm
    finally:
        sys.path.remove(str(ROOT / "tests" / "projects"))
    out = tmp_path_factory.mktemp("inspect")
    cfg = {"vocab": 64, "max_len": 32}
    _, exc = record(rk_lm, cfg, _lm_batches(rk_lm, cfg, False), out / "plain", snapshot_every=3)
    _, exc16 = record(rk_lm, cfg, _lm_batches(rk_lm, cfg, True), out / "bf16", snapshot_every=3)
    return bundle_of(exc), bundle_of(exc16)


FINDING = "input_ids row 5 position 7 = 67 >= num_embeddings 64 of tok"


def test_inspect_text_does_not_import_torch(oov_bundle):
    out, loaded = _run_inspect(str(oov_bundle[0]))
    assert loaded == []
    assert FINDING in out  # the batch diagnosis read the failing step's tensors, through numpy
    assert "state    model " in out and "input_ids: int64[8, 12]; labels: int64[8, 12]" in out


def test_inspect_json_does_not_import_torch(oov_bundle):
    out, loaded = _run_inspect(str(oov_bundle[0]), "--json")
    assert loaded == []
    d = json.loads(out)
    assert [f["message"] for f in d["diagnosis"]["findings"]] == [FINDING]
    assert d["batch"]["input_ids"] == {"shape": [8, 12], "dtype": "int64"}
    assert d["state"]["model"] > 0 and d["state"]["optimizer"] > 0 and d["state"]["rng"] > 0


def test_inspect_batch_does_not_import_torch(oov_bundle):
    out, loaded = _run_inspect(str(oov_bundle[0]), "--batch", "--rows", "5", "--json")
    assert loaded == []
    row = json.loads(out)["batch_values"]["leaves"]["input_ids"]["rows"]["5"]
    assert row["values"][7] == 67 and len(row["values"]) == 12 and all(isinstance(v, int) for v in row["values"])


@pytest.mark.slow
def test_inspect_archive_does_not_import_torch(oov_bundle, tmp_path):
    archive = pack(oov_bundle[0], tmp_path / "repro.tar.gz").output
    out, loaded = _run_inspect(str(archive))
    assert loaded == []
    assert FINDING in out


@pytest.mark.slow
def test_a_bf16_batch_is_read_through_torch_and_diagnosed_the_same(oov_bundle):
    """numpy has no bfloat16: that one step file falls back to torch, and the output is what it always was."""
    out, loaded = _run_inspect(str(oov_bundle[1]), "--json", "--batch", "--rows", "3")
    assert "torch" in loaded
    d = json.loads(out)
    assert d["batch"]["weights"] == {"shape": [8], "dtype": "bfloat16"}
    messages = [f["message"] for f in d["diagnosis"]["findings"]]
    assert FINDING in messages and "weights: 1 NaN and 0 inf value(s) at position 3" in messages
    values = d["batch_values"]["leaves"]["weights"]
    assert values["dtype"] == "bfloat16" and values["rows"]["3"]["values"] == ["nan"]


@pytest.mark.slow
def test_numpy_leaves_are_diagnosed_and_printed(oov_bundle):
    """A batch leaf recorded as a numpy array is checked like a tensor (it used to be skipped) and
    `--batch` prints it (it used to fail with an internal error)."""
    out, _ = _run_inspect(str(oov_bundle[1]), "--json", "--batch", "--rows", "1")
    d = json.loads(out)
    assert "np_w row 1: 0 NaN and 1 inf value(s), first at position 1" in [f["message"] for f in d["diagnosis"]["findings"]]
    leaf = d["batch_values"]["leaves"]["np_w"]
    assert leaf["dtype"] == "float32" and leaf["rows"]["1"]["values"] == [1.0, "inf"]


def test_a_tampered_batch_file_is_refused_before_its_tensors_are_read(oov_bundle, tmp_path):
    """The numpy path hashes the step file first: one flipped byte of tensor data (header intact, size the
    same) is a checksum mismatch, exit 3, never a diagnosis of altered values."""
    bundle = tmp_path / "b"
    shutil.copytree(oov_bundle[0], bundle)
    step_file = bundle / "steps" / "00000004.safetensors"
    raw = bytearray(step_file.read_bytes())
    raw[-1] ^= 1
    step_file.write_bytes(bytes(raw))
    r = CliRunner().invoke(main, ["inspect", str(bundle), "--json"])
    assert r.exit_code == 3, r.output
    error = json.loads(r.stdout)["error"]
    assert "steps/00000004.safetensors: checksum mismatch" in error["message"], error
