"""Bundle I/O at disk speed, and bounded time on crafted archives."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rk_testing import record_mlp_nan, reseal

import reprokit
from reprokit import archive, pack
from reprokit import bundle as B
from reprokit.bundle import reader, tensorfile
from reprokit.cli import main
from reprokit.errors import BundleError

ROOT = Path(__file__).resolve().parents[2]


# --- start-up -------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--help", "--version"])
@pytest.mark.slow
def test_help_and_version_do_not_import_torch(flag):
    code = textwrap.dedent(f"""
        import sys
        from reprokit.cli import main
        try:
            main([{flag!r}])
        except SystemExit as e:
            assert e.code == 0, e.code
        loaded = sorted(m for m in ("torch", "numpy", "safetensors") if m in sys.modules)
        assert not loaded, loaded
        import reprokit
        assert "torch" not in sys.modules
        assert reprokit.Recorder.__name__ == "Recorder" and "torch" in sys.modules  # loaded on first use
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr


def test_lazy_names_match_the_public_api():
    import reprokit

    assert set(reprokit._LAZY) <= set(reprokit.__all__)
    for name in reprokit.__all__:
        assert getattr(reprokit, name) is not None
    assert archive.MANIFEST == B.MANIFEST and archive.PACK_MANIFEST == pack.PACK_MANIFEST
    assert "bundle/tensorfile.py" in pack.runtime_files() and "record.py" in pack.runtime_files()


# --- the one tensor writer and reader ----------------------------------------------------

def test_tensor_file_round_trip_is_exact_and_hashed_on_the_way(tmp_path):
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {
        "odd": torch.arange(3, dtype=torch.uint8),  # puts the next tensor off 4-byte alignment
        "big": torch.randn(300_000),  # > 1 MiB: a view of the read buffer, hashed in the helper thread
        "t": base.t(),  # not contiguous
        "view": base[1],  # shares storage with base
        "base": base,
        "bf16": torch.randn(5).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
        "mask": torch.tensor([True, False]),
    }
    path = tmp_path / "x.safetensors"
    sha, size = tensorfile.write_safetensors(path, tensors, chunk=1 << 20)
    assert (sha, size) == (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_size)
    back = tensorfile.read_verified(path, sha, size)
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t), k
    from safetensors.torch import load_file  # the reference reader agrees

    assert all(torch.equal(load_file(path)[k], t) for k, t in tensors.items())
    with pytest.raises(tensorfile.TensorFileError, match="checksum mismatch"):
        tensorfile.read_verified(path, "0" * 64, size)
    with pytest.raises(tensorfile.TensorFileError, match="size mismatch"):
        tensorfile.read_verified(path, sha, size - 1)


@pytest.fixture(scope="module")
def sharded_bundle(tmp_path_factory):
    """A bundle whose state is split over several files (files of at most 2 KiB instead of 256 MiB)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tensorfile, "SHARD_BYTES", 2048)
        return record_mlp_nan(tmp_path_factory.mktemp("sharded") / "repros", steps=6, poison_step=4, snapshot_every=3)


def test_shards_keep_key_order_and_stay_under_the_size_unless_one_tensor_is_larger():
    tensors = {f"t{i:02d}": torch.zeros(n) for i, n in enumerate([10, 300, 5, 1000, 1, 0, 40])}
    parts = tensorfile.shard(tensors, shard_bytes=1204)
    assert [k for p in parts for k in p] == sorted(tensors), "every tensor once, in key order"
    for p in parts:
        size = sum(t.numel() * 4 for t in p.values())
        assert size <= 1204 or len(p) == 1, (list(p), size)
    # 40 + 1200 bytes > 1204: t01 starts a part, and t02 the next (1200 + 20); t03 (4000 bytes) is a part alone
    assert [list(p) for p in parts] == [["t00"], ["t01"], ["t02"], ["t03"], ["t04", "t05", "t06"]]
    assert tensorfile.shard({}) == [{}], "an empty state is one (empty) file"


@pytest.mark.slow
def test_a_state_in_several_files_replays_packs_and_refuses_a_missing_part(sharded_bundle, tmp_path):
    b = B.open_bundle(sharded_bundle)
    names = B.state_files(b.manifest["files"])
    assert len(names) >= 3 and names[0] == B.STATE_TENSORS and names[1] == "state/state-1.safetensors", names
    assert b.manifest["version"] == 2
    _, tensors = b.state()
    parts = [tensorfile.read_verified(b.path / n, b.manifest["files"][n]["sha256"], b.manifest["files"][n]["size"])
             for n in names]
    assert sum(len(p) for p in parts) == len(tensors), "no tensor in two parts, none lost"
    report = reprokit.replay(sharded_bundle, times=2)
    assert report.reproduced and report.fidelity["bit_exact"], report.to_json()
    r = CliRunner().invoke(main, ["pack", str(sharded_bundle), "-o", str(tmp_path / "r.tar"), "--json"])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["replay", str(tmp_path / "r.tar"), "--json"])
    assert r.exit_code == 1 and json.loads(r.stdout)["verdict"] == "deterministic", r.output

    gap = tmp_path / "gap"  # a manifest (re-signed) that lost part 1 of the state: never loaded as a part state
    shutil.copytree(sharded_bundle, gap)
    reseal(gap, lambda m: m["files"].pop("state/state-1.safetensors"))
    (gap / "state/state-1.safetensors").unlink()
    assert {"file": "state/state-1.safetensors", "problem": f"not in the manifest, which lists {len(names) - 1} other "
            "part(s) of the state: the state is incomplete"} in B.verify(gap)
    with pytest.raises(BundleError, match="state/state-1.safetensors: not in the manifest"):
        B.open_bundle(gap)


def test_each_state_file_is_handed_on_once_it_is_verified_and_a_tampered_one_never(sharded_bundle, tmp_path):
    """``Bundle.state(on_part=...)`` (replay's GPU preload) sees every state file's tensors once, the very tensors
    the state is made of, and never a file whose digest does not match."""
    import threading

    b = B.open_bundle(sharded_bundle)
    seen: list[dict[str, torch.Tensor]] = []
    lock = threading.Lock()

    def on_part(part):
        with lock:
            seen.append(part)

    _, tensors = b.state(on_part=on_part)
    assert len(seen) == len(B.state_files(b.manifest["files"])) >= 3
    assert sorted(k for p in seen for k in p) == sorted(tensors)
    assert all(t is tensors[k] for p in seen for k, t in p.items())

    bad = tmp_path / "bad"
    shutil.copytree(sharded_bundle, bad)
    part1 = bad / "state/state-1.safetensors"
    meta = b.manifest["files"]["state/state-1.safetensors"]
    tampered = set(tensorfile.read_verified(part1, meta["sha256"], meta["size"]))
    data = bytearray(part1.read_bytes())
    data[-1] ^= 0xFF  # a flipped bit in the last tensor's data: same size, same header, another digest
    part1.write_bytes(bytes(data))
    seen.clear()
    with pytest.raises(BundleError, match="state-1.safetensors: checksum mismatch"):
        B.open_bundle(bad).state(on_part=on_part)
    assert not any(tampered & p.keys() for p in seen), "the tampered file's tensors are never handed on"


@pytest.mark.slow
def test_batches_read_while_the_state_is_read_are_the_recorded_ones_and_a_bad_one_fails_where_asked(shared_nan_bundle,
                                                                                                     tmp_path):
    """A replay session reads the window's batches on a thread during the load (its first ``inputs()`` takes them):
    the same batches and RNG states as reading them on demand; a step file that fails its digest raises only where
    that step is asked for, as before."""
    import threading

    from reprokit.replayer import Session

    b = B.open_bundle(shared_nan_bundle)
    step, readers = b.step, []

    def step_read_by(k):
        readers.append(threading.current_thread().name)
        return step(k)

    b.step = step_read_by  # type: ignore[method-assign]
    with Session(b) as s:
        ahead = s.inputs()
        assert readers and all(r.startswith("reprokit-steps") for r in readers), readers
        readers.clear()
        again = s.inputs()  # read on demand now
        assert readers == [threading.current_thread().name] * len(again)
    assert [i.step for i in ahead] == list(b.steps) and len(ahead) >= 2
    assert [i.digest for i in ahead] == [i.digest for i in again]
    assert all(torch.equal(x.rng_tensors[k], y.rng_tensors[k]) and x.rng == y.rng
               for x, y in zip(ahead, again) for k in x.rng_tensors)

    bad = tmp_path / "bad"
    shutil.copytree(shared_nan_bundle, bad)
    first, last = B.open_bundle(bad).steps[0], B.open_bundle(bad).steps[-1]
    f = bad / f"steps/{first:08d}.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with Session(B.open_bundle(bad)) as s:
        assert [i.step for i in s.inputs([last])] == [last], "the tampered step was not asked for"
    with Session(B.open_bundle(bad)) as s, pytest.raises(BundleError, match=f"{first:08d}.safetensors: checksum"):
        s.inputs()


def test_a_gpu_copy_that_fails_drops_the_preload_and_says_why():
    """Copies to a device that cannot take them (here one that does not exist, on any machine): nothing is kept, the
    restore will read host memory, and the error is kept for diagnosis."""
    from reprokit.replayer import _Preload

    p = _Preload(torch.device("cuda", 99))
    assert p.wants("model/w", torch.ones(3)) and not p.wants("model/b._extra_state/count", torch.ones(3))
    assert p.wants("optimizer/state/0/exp_avg", torch.ones(3)) and not p.wants("optimizer/state/0/step", torch.ones(3))
    p({"model/w": torch.ones(3), "optimizer/state/0/exp_avg": torch.ones(3)})
    assert p.error is not None and p.take() == {}
    p({"model/w": torch.ones(3)})  # later parts are not copied either
    assert p.take() == {}


def test_a_tensor_in_two_state_files_is_refused(sharded_bundle, tmp_path):
    twice = tmp_path / "twice"
    shutil.copytree(sharded_bundle, twice)
    first = twice / B.STATE_TENSORS
    shutil.copy(first, twice / "state/state-1.safetensors")  # part 1 now repeats part 0's tensors
    reseal(twice)
    with pytest.raises(BundleError, match="state/state-1.safetensors: tensor '.*' is also in another state file"):
        B.open_bundle(twice)


def test_tampered_tensor_file_is_refused_when_loaded_packed_verified_and_replayed(shared_nan_bundle, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(shared_nan_bundle, bad)
    state = bad / B.STATE_TENSORS
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF  # same size, same header: only the digest can tell
    state.write_bytes(bytes(data))
    b = B.open_bundle(bad)  # JSON, code and sizes: fine
    with pytest.raises(BundleError, match="checksum mismatch"):
        b.state()
    with pytest.raises(BundleError, match="does not match the bundle's manifest"):
        pack.pack(bad, tmp_path / "out" / "r.tar")
    assert list((tmp_path / "out").iterdir()) == [], "nothing packed, no temp file left"
    assert any(p["problem"] == "checksum mismatch" for p in B.verify(bad))
    r = CliRunner().invoke(main, ["replay", str(bad), "--json"])
    assert r.exit_code == 3, r.output


def test_inspect_does_not_hash_tensors_and_says_so(shared_nan_bundle):
    r = CliRunner().invoke(main, ["inspect", str(shared_nan_bundle)])
    assert r.exit_code == 0, r.output
    assert "tensor files checked for size and header only, not hashed" in r.output


def test_total_json_bytes_are_capped(shared_nan_bundle, monkeypatch):
    monkeypatch.setattr(reader, "MAX_TOTAL_JSON_BYTES", 100)
    problems = B.verify(shared_nan_bundle)
    assert len(problems) == 1 and "bytes of JSON files" in problems[0]["problem"], problems


# --- the container ----------------------------------------------------------------------

def test_pack_writes_a_plain_tar_that_tar_lists_and_reprokit_opens(shared_nan_bundle, tmp_path, monkeypatch):
    out = tmp_path / "repro.tar"
    res = pack.pack(shared_nan_bundle, out)
    raw = out.read_bytes()
    assert raw[:2] != b"\x1f\x8b" and raw[257:262] == b"ustar", "uncompressed POSIX tar"
    assert res.sha256 == hashlib.sha256(raw).hexdigest()
    assert (tmp_path / "repro.tar.sha256").read_text() == f"{res.sha256}  repro.tar\n"
    if shutil.which("tar"):
        listed = subprocess.run(["tar", "-tf", str(out)], capture_output=True, text=True, check=True).stdout.split()
        assert f"{res.folder}/bundle/{B.STATE_TENSORS}" in listed
    assert archive.is_archive(out)
    v = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert v.exit_code == 0 and json.loads(v.output)["ok"], v.output
    # same bundle in, same bytes out; a .tar.gz name still gets gzip (what earlier versions wrote)
    assert pack.pack(shared_nan_bundle, tmp_path / "again.tar").sha256 == res.sha256
    gz = pack.pack(shared_nan_bundle, tmp_path / "old.tar.gz")
    assert gz.output.read_bytes()[:2] == b"\x1f\x8b" and gzip.decompress(gz.output.read_bytes())[:512] == raw[:512]
    with archive.extracted(gz.output) as d:
        assert B.verify(d) == []


def test_truncated_plain_tar_is_refused(shared_nan_bundle, tmp_path):
    out = pack.pack(shared_nan_bundle, tmp_path / "r.tar").output
    cut = tmp_path / "cut.tar"
    cut.write_bytes(out.read_bytes()[: out.stat().st_size // 2])
    problems = archive.scan(cut, archive.Limits())
    assert problems and "truncated" in problems[-1]["problem"], problems


# --- bounded time on crafted archives ---------------------------------------------------------

def _block(name: bytes, typ: bytes, size: int) -> bytes:
    b = bytearray(512)
    b[:len(name)] = name
    b[100:108] = b"0000644\0"
    b[108:116] = b[116:124] = b"0000000\0"
    b[124:136] = b"%011o\0" % size
    b[136:148] = b"00000000000\0"
    b[156:157] = typ
    b[257:263] = b"ustar\0"
    b[263:265] = b"00"
    b[148:156] = b" " * 8
    b[148:156] = b"%06o\0 " % sum(b)
    return bytes(b)


def _pax_archive(path: Path, record: bytes, compress: bool) -> Path:
    data = _block(b"PaxHeaders/x", b"x", len(record)) + record + bytes(-len(record) % 512)
    data += _block(b"x", b"0", 1) + b"x" + bytes(511) + bytes(1024)
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("case", ["200k-digit length", "200k-digit size, cap raised", "5000-digit size"])
def test_crafted_pax_headers_are_refused_in_bounded_time(tmp_path, case, compress):
    """CPython's tarfile takes 79-135 s on a 200,000-digit pax record; ours refuses at once."""
    digits = b"9" * (5000 if case == "5000-digit size" else 200_000)
    if case == "200k-digit length":
        record = digits + b" path=x\n"
    else:
        body = b" size=" + digits + b"\n"
        total = next(len(body) + d for d in range(1, 10) if len(str(len(body) + d)) == d)
        record = b"%d" % total + body  # a well-formed record: only its value is hostile
    path = _pax_archive(tmp_path / ("evil.tar.gz" if compress else "evil.tar"), record, compress)
    limits = archive.Limits(max_header_bytes=1 << 20) if "raised" in case or "5000" in case else archive.Limits()
    t0 = time.perf_counter()
    problems = archive.scan(path, limits)
    assert time.perf_counter() - t0 < 5.0
    assert problems and any(w in problems[-1]["problem"] for w in ("max_header_bytes", "pax")), problems
    t0 = time.perf_counter()
    r = CliRunner().invoke(main, ["verify", str(path), "--json"])
    assert time.perf_counter() - t0 < 5.0
    assert r.exit_code == 1 and not json.loads(r.output)["ok"], r.output


def test_version_works_from_a_checkout_that_is_not_installed(tmp_path):
    """`python -m reprokit --version` from a plain copy on the path (no package metadata: the GPU machine's case)."""
    import shutil

    import click

    from reprokit._version import __version__

    shutil.copytree(ROOT / "reprokit", tmp_path / "reprokit", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(Path(click.__file__).parent, tmp_path / "click", ignore=shutil.ignore_patterns("__pycache__"))
    # -S: no site-packages, so neither reprokit's nor anything's metadata is found
    proc = subprocess.run([sys.executable, "-S", "-m", "reprokit", "--version"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and __version__ in proc.stdout, proc.stdout + proc.stderr


def test_a_window_is_verified_while_the_interpreter_exits(shared_nan_bundle):
    """The incident watcher checks its rank's window when the main thread has already ended (the rank's collective
    failed, its script returned): concurrent.futures then refuses new work. Verification must still answer (it said
    "could not verify: RuntimeError('cannot schedule new futures after interpreter shutdown')" on a 16-core host)."""
    script = textwrap.dedent("""
        import json, sys, threading, time
        from reprokit.bundle import verify

        def late():
            time.sleep(0.5)  # the main thread has returned: the interpreter's exit has begun
            print(json.dumps(verify(sys.argv[1])), flush=True)

        threading.Thread(target=late).start()  # not a daemon: the exit waits for it
    """)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script, str(shared_nan_bundle)], capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout) == [], proc.stdout
