"""`reprokit pack`, and opening archives from other people safely."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path

import pytest
from click.testing import CliRunner

from reprokit import bundle as B
from reprokit import gzip_members
from reprokit.archive import Limits, extracted
from reprokit.cli import main
from reprokit.errors import BundleError
from reprokit.pack import pack


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    """Point tempfile at a folder we can list, so "nothing was written anywhere else" can be checked."""
    d = tmp_path / "scratch"
    d.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    return d


@pytest.mark.slow
def test_round_trip_pack_verify_replay(nan_bundle, tmp_path, scratch):
    out = tmp_path / "ship" / "repro.tar.gz"
    r = CliRunner().invoke(main, ["pack", str(nan_bundle), "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert (out.parent / "repro.tar.gz.sha256").read_text() == f"{d['sha256']}  repro.tar.gz\n"
    assert d["breakdown"]["state"] > 0 and d["breakdown"]["batches"] > 0 and d["breakdown"]["runtime"] > 0
    v = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert v.exit_code == 0 and json.loads(v.output)["ok"], v.output
    rep = CliRunner().invoke(main, ["replay", str(out), "--json"])
    assert rep.exit_code == 1 and json.loads(rep.stdout)["verdict"] == "deterministic"
    ins = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    sizes = json.loads(ins.output)["sizes"]
    assert sizes["runtime"] > 0 and sizes["state"] > 0 and sizes["batches"] > 0
    assert list(scratch.iterdir()) == [], "the temporary extraction is cleaned up"
    with tarfile.open(out) as tf:
        names = tf.getnames()
    top = names[0]
    assert {f"{top}/repro.py", f"{top}/README.md", f"{top}/reprokit/replayer.py", f"{top}/bundle/manifest.json",
            f"{top}/bundle/code/rk_mlp.py"} <= set(names)
    assert not any(n.endswith(("cli.py", "pack.py", "archive.py")) or "/shrink/" in n for n in names), \
        "only what replay needs"


def test_pack_is_deterministic(nan_bundle, tmp_path):
    a = pack(nan_bundle, tmp_path / "a" / "repro.tar.gz")
    os.utime(nan_bundle / "run.json", (1, 1))  # mtimes on disk must not leak into the archive
    b = pack(nan_bundle, tmp_path / "b" / "other-name.tar.gz")
    assert (tmp_path / "a" / "repro.tar.gz").read_bytes() == (tmp_path / "b" / "other-name.tar.gz").read_bytes()
    assert a.sha256 == b.sha256


def _gzip_members(data: bytes) -> list[tuple[int, bytes]]:
    """Each gzip member of ``data``: its length and what it holds, read on its own (zlib checks CRC and length)."""
    out = []
    while data:
        d = zlib.decompressobj(31)  # wbits 31: exactly one gzip member
        raw = d.decompress(data) + d.flush()
        assert d.eof, "a member cut short"
        out.append((len(data) - len(d.unused_data), raw))
        data = d.unused_data
    return out


def test_a_compressed_pack_is_gzip_members_that_every_reader_opens(shared_nan_bundle, tmp_path, monkeypatch):
    """``pack -o X.tar.gz`` writes the plain pack's tar stream as many gzip members (compressed on threads, stored
    where deflate saves little): reprokit's reader opens it under explicit caps, tarfile with the data filter, tar."""
    monkeypatch.setattr(gzip_members, "BLOCK", 16 << 10)  # the small bundle spans many members
    plain = pack(shared_nan_bundle, tmp_path / "repro.tar")
    gz = pack(shared_nan_bundle, tmp_path / "repro.tar.gz")
    members = _gzip_members(gz.output.read_bytes())
    assert len(members) > 10 and b"".join(raw for _, raw in members) == plain.output.read_bytes()
    assert gzip.decompress(gz.output.read_bytes()) == plain.output.read_bytes() and gz.folder == plain.folder
    with tarfile.open(plain.output) as tf:
        infos = tf.getmembers()
    biggest, total = max(m.size for m in infos), sum(m.size for m in infos)

    fits = Limits(max_members=len(infos), max_file_bytes=biggest, max_total_bytes=total)
    with extracted(gz.output, limits=fits) as d:
        assert B.verify(d) == [] and d.parent.name == gz.folder
    for tight, problem in ((Limits(max_file_bytes=biggest - 1), "above max_file_bytes"),
                           (Limits(max_total_bytes=total - 1), "(max_total_bytes)"),
                           (Limits(max_members=len(infos) - 1), f"more than {len(infos) - 1} members")):
        with pytest.raises(BundleError) as e, extracted(gz.output, limits=tight):
            pass
        assert any(problem in p["problem"] for p in e.value.problems), e.value.problems
    code, d = _verify(gz.output, "--max-members", str(len(infos)), "--max-file-bytes", str(biggest),
                      "--max-total-bytes", str(total))
    assert code == 0 and d["ok"] and d["origin_checked"], d

    with tarfile.open(gz.output, "r:gz") as tf:
        tf.extractall(tmp_path / "unpacked", filter="data")
    top = tmp_path / "unpacked" / gz.folder
    assert B.verify(top / "bundle") == [] and (top / "repro.py").stat().st_mode & 0o100
    if shutil.which("tar"):
        listed = subprocess.run(["tar", "-tzf", str(gz.output)], capture_output=True, text=True, check=True)
        assert f"{gz.folder}/bundle/{B.STATE_TENSORS}" in listed.stdout.split()

    data = bytearray(gz.output.read_bytes())
    data[members[0][0] - 8] ^= 0x01  # the first member's CRC: a damaged member anywhere is caught, not only the last
    damaged = tmp_path / "damaged.tar.gz"  # no .sha256 beside it: the gzip check itself must catch it
    damaged.write_bytes(bytes(data))
    code, d = _verify(damaged)
    assert code == 1 and any("not a readable .tar.gz" in p["problem"] for p in d["problems"]), d


def test_pack_refuses_a_tampered_bundle(nan_bundle, tmp_path):
    (nan_bundle / "run.json").write_text("{}")
    r = CliRunner().invoke(main, ["pack", str(nan_bundle), "-o", str(tmp_path / "x.tar.gz")])
    assert r.exit_code == 3 and "run.json: checksum mismatch" in r.output
    assert not (tmp_path / "x.tar.gz").exists()


@pytest.mark.slow
def test_hand_off_runs_with_only_torch_numpy_safetensors(nan_bundle, tmp_path):
    from rk_forked import hand_off_env, shared_bare

    out = tmp_path / "repro.tar.gz"
    pack(nan_bundle, out)
    unpacked = tmp_path / "colleague"
    unpacked.mkdir()
    with tarfile.open(out) as tf:
        tf.extractall(unpacked, filter="data")
    (top,) = list(unpacked.iterdir())
    # The repro runs forked from a python -S server with only the minimal site on its path (torch imported once):
    # what a fresh `python -S repro.py` with this environment imports, and nothing more (checked in
    # test_extract.py::test_a_hand_off_run_has_the_import_path_of_a_fresh_python_s_process).
    server = shared_bare()
    # -S: no site-packages at all; the import path is the minimal site plus the extracted folder.
    env = hand_off_env(server.site, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = subprocess.run([sys.executable, "-S", "-c", "import click"], env=env, cwd=elsewhere,
                           capture_output=True, text=True)
    assert probe.returncode != 0, "click must not be importable in the hand-off environment"
    probe = subprocess.run([sys.executable, "-S", "-c", "import git"], env=env, cwd=elsewhere, capture_output=True)
    assert probe.returncode != 0
    proc = server.capture(["--json", "--times", "2"], script=top / "repro.py", cwd=elsewhere, env=env,
                          replace_env=True, timeout=300)
    # Exit 1 means "reproduced", but an uncaught exception also exits 1: require the JSON and no traceback.
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    d = json.loads(proc.stdout)
    assert d["verdict"] == "deterministic" and d["failure"]["kind"] == "nonfinite_loss" and d["failure"]["step"] == 6
    assert d["fidelity"]["bit_exact"] and str(top) in d["code"]
    human = server.capture([], script=top / "repro.py", cwd=elsewhere, env=env, replace_env=True, timeout=300)
    assert human.returncode == 1 and "REPRODUCED: 1/1" in human.stdout


# --- hostile archives -------------------------------------------------------------

def _tar_gz(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    path.write_bytes(gzip.compress(buf.getvalue()))
    return path


def _f(name: str, data: bytes = b"x", **kw) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for k, v in kw.items():
        setattr(info, k, v)
    return info, data


def _special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info, None


HOSTILE = {
    "absolute": ([_f("/tmp/reprokit-pwned")], "/tmp/reprokit-pwned", "absolute path"),
    "dotdot": ([_f("repro/../../evil.txt")], "repro/../../evil.txt", "escapes"),
    "symlink_out": ([_special("repro/link", tarfile.SYMTYPE, "/etc/passwd")], "repro/link", "symlink -> /etc/passwd"),
    "symlink_in": ([_f("repro/a"), _special("repro/b", tarfile.SYMTYPE, "a")], "repro/b", "symlink -> a"),
    "hardlink_out": ([_special("repro/h", tarfile.LNKTYPE, "/etc/shadow")], "repro/h", "hard link -> /etc/shadow"),
    "hardlink_in": ([_f("repro/a"), _special("repro/h", tarfile.LNKTYPE, "repro/a")], "repro/h", "hard link"),
    "fifo": ([_special("repro/pipe", tarfile.FIFOTYPE)], "repro/pipe", "FIFO"),
    "device": ([_special("repro/sda", tarfile.BLKTYPE)], "repro/sda", "device"),
    "duplicate": ([_f("repro/manifest.json"), _f("repro/manifest.json")], "repro/manifest.json", "duplicate name"),
    "case_collision": ([_f("repro/Run.json"), _f("repro/run.json")], "repro/run.json", "collides case-insensitively"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_archive_is_refused_and_nothing_is_written(case, tmp_path, scratch):
    members, member, message = HOSTILE[case]
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    archive = _tar_gz(inbox / "evil.tar.gz", members)
    before = sorted(p.name for p in tmp_path.iterdir())
    for cmd in (["verify", "--json"], ["replay"], ["inspect"]):
        r = CliRunner().invoke(main, [cmd[0], str(archive), *cmd[1:]])
        if cmd[0] == "verify":
            assert r.exit_code == 1, r.output
            problems = json.loads(r.output)["problems"]
            assert any(p["file"] == member and message in p["problem"] for p in problems), problems
        else:
            assert r.exit_code == 3 and member in r.output and "nothing was written" in r.output, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert list(scratch.iterdir()) == [] and sorted(p.name for p in inbox.iterdir()) == ["evil.tar.gz"]
    assert not Path("/tmp/reprokit-pwned").exists()


def test_every_problem_is_reported_not_just_the_first(tmp_path, scratch):
    archive = _tar_gz(tmp_path / "evil.tar.gz", HOSTILE["absolute"][0] + HOSTILE["fifo"][0] + HOSTILE["dotdot"][0])
    r = CliRunner().invoke(main, ["verify", str(archive), "--json"])
    files = [p["file"] for p in json.loads(r.output)["problems"]]
    assert files == ["/tmp/reprokit-pwned", "repro/pipe", "repro/../../evil.txt"]


@pytest.mark.slow
def test_gzip_bomb_is_refused_quickly(tmp_path, scratch):
    """~5 MB on disk that would inflate to 5 GiB: refused by the ratio cap, long before that."""
    head = tarfile.TarInfo("repro/bomb.bin")
    head.size = 5 << 30
    chunk = zlib.compressobj(9, zlib.DEFLATED, 31)
    member = chunk.compress(bytes(64 << 20)) + chunk.flush()  # one gzip member: 64 MiB of zeros
    with open(tmp_path / "bomb.tar.gz", "wb") as f:
        f.write(gzip.compress(head.tobuf(tarfile.GNU_FORMAT)))
        for _ in range(80):
            f.write(member)
    assert (tmp_path / "bomb.tar.gz").stat().st_size < 8 << 20
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "bomb.tar.gz"), "--json"])
    assert r.exit_code == 1
    assert any("decompression bomb" in p["problem"] for p in json.loads(r.output)["problems"]), r.output
    small = CliRunner().invoke(main, ["verify", str(tmp_path / "bomb.tar.gz"), "--json", "--max-file-bytes", "1000000"])
    assert any(p["file"] == "repro/bomb.bin" and "above max_file_bytes" in p["problem"]
               for p in json.loads(small.output)["problems"])
    assert list(scratch.iterdir()) == []


@pytest.mark.slow
def test_a_million_empty_members_is_refused(tmp_path, scratch):
    header = tarfile.TarInfo("repro/e").tobuf(tarfile.GNU_FORMAT)
    block = gzip.compress(header * 10_000)
    with open(tmp_path / "many.tar.gz", "wb") as f:
        for _ in range(100):  # 100 gzip members x 10,000 headers = a million members
            f.write(block)
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "many.tar.gz"), "--json"])
    problems = json.loads(r.output)["problems"]
    assert r.exit_code == 1 and any("more than 100000 members" in p["problem"] for p in problems)
    assert len(problems) <= 102, "the report is capped, not a million lines"
    assert list(scratch.iterdir()) == []


def test_archive_sha256_checked_before_decompressing(nan_bundle, tmp_path, scratch):
    out = tmp_path / "repro.tar.gz"
    res = pack(nan_bundle, out)
    ok = CliRunner().invoke(main, ["verify", str(out), "--sha256", res.sha256])
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(main, ["replay", str(out), "--sha256", "0" * 64])
    assert bad.exit_code == 3 and "nothing was decompressed" in bad.output
    typo = CliRunner().invoke(main, ["verify", str(out), "--sha256", "abcd"])  # not a digest: a usage error
    assert typo.exit_code == 2 and "expected a sha256: 64 hex digits, got 'abcd'" in typo.output, typo.output
    data = bytearray(out.read_bytes())
    data[len(data) // 2] ^= 0x01
    out.write_bytes(bytes(data))
    side = CliRunner().invoke(main, ["verify", str(out), "--json"])
    assert side.exit_code == 1
    assert json.loads(side.output)["problems"][0]["problem"] == "archive sha256 does not match repro.tar.gz.sha256"


def test_flipped_byte_in_any_file_names_exactly_that_file(nan_bundle, tmp_path):
    files = sorted(p for p in nan_bundle.rglob("*") if p.is_file())
    assert len(files) > 8
    for path in files:
        original = path.read_bytes()
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x01
        path.write_bytes(bytes(flipped))
        rel = path.relative_to(nan_bundle).as_posix()
        problems = B.verify(nan_bundle)
        assert [p["file"] for p in problems] == [rel], (rel, problems)
        path.write_bytes(original)
    assert B.verify(nan_bundle) == []


def test_missing_and_extra_files_in_an_archive_are_reported_distinctly(nan_bundle, tmp_path):
    (nan_bundle / "steps" / "00000005.json").unlink()
    (nan_bundle / "extra.bin").write_bytes(b"?")
    with tarfile.open(tmp_path / "b.tar.gz", "w:gz") as tf:
        tf.add(nan_bundle, arcname="mybundle")
    r = CliRunner().invoke(main, ["verify", str(tmp_path / "b.tar.gz"), "--json"])
    problems = {p["file"]: p["problem"] for p in json.loads(r.output)["problems"]}
    assert problems == {"steps/00000005.json": "missing", "extra.bin": "unexpected file"}


class _Planted:
    """Unpickling this writes a marker file: proof that someone unpickled bundle content."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "pwned"))


def test_planted_pickle_is_never_unpickled(nan_bundle, tmp_path):
    marker = tmp_path / "MARKER"
    payload = pickle.dumps(_Planted(marker))
    assert not marker.exists()
    (nan_bundle / "state" / "model.pt").write_bytes(payload)
    # Unlisted: verify flags it, replay refuses to load the bundle at all.
    v = CliRunner().invoke(main, ["verify", str(nan_bundle), "--json"])
    assert {"file": "state/model.pt", "problem": "unexpected file"} in json.loads(v.output)["problems"]
    assert CliRunner().invoke(main, ["replay", str(nan_bundle)]).exit_code == 3
    # Listed by an attacker who re-signed the manifest: beyond the bundle layout, so still refused (pack would ship
    # it), and nothing unpickles it on the way.
    m = json.loads((nan_bundle / "manifest.json").read_text())
    m["files"]["state/model.pt"] = {"sha256": B.sha256_file(nan_bundle / "state" / "model.pt"), "size": len(payload)}
    m["self_sha256"] = B._self_digest(m)
    (nan_bundle / "manifest.json").write_text(json.dumps(m))
    v = CliRunner().invoke(main, ["verify", str(nan_bundle)])
    assert v.exit_code == 1 and "state/model.pt: not part of the bundle layout" in v.output, v.output
    for args in (["inspect", str(nan_bundle)], ["replay", str(nan_bundle)],
                 ["pack", str(nan_bundle), "-o", str(tmp_path / "p.tar.gz")]):
        assert CliRunner().invoke(main, args).exit_code == 3, args
    assert not marker.exists()


# --- integrity: the whole stream, every file, bounded reads -------------------------------------------------

def _packed(nan_bundle: Path, tmp_path: Path, *, sidecar: bool = False) -> Path:
    out = tmp_path / "ship" / "repro.tar.gz"
    pack(nan_bundle, out)
    if not sidecar:
        (out.parent / "repro.tar.gz.sha256").unlink()
    return out


def _verify(archive: Path, *args: str) -> tuple[int, dict]:
    r = CliRunner().invoke(main, ["verify", str(archive), "--json", *args])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception  # never a traceback
    return r.exit_code, json.loads(r.output)


def _raw_member(name: str, data: bytes, kind: bytes = tarfile.REGTYPE) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.type = len(data), kind
    return info.tobuf(tarfile.GNU_FORMAT) + data + bytes(-len(data) % 512)


def _raw_bundle_tar(bundle: Path, top: str = "mybundle") -> bytes:
    """A bundle folder as tar members (no end marker), what ``tar cf`` of the folder holds."""
    return b"".join(_raw_member(f"{top}/{p.relative_to(bundle).as_posix()}", p.read_bytes())
                    for p in sorted(bundle.rglob("*")) if p.is_file())


def test_packed_manifest_lists_every_file_of_the_archive(nan_bundle, tmp_path):
    out = _packed(nan_bundle, tmp_path)
    with tarfile.open(out) as tf:
        names = {m.name.split("/", 1)[1]: m for m in tf.getmembers() if m.isfile()}
        listed = json.loads(tf.extractfile(names["pack-manifest.json"]).read())["files"]
    assert set(listed) == set(names) - {"pack-manifest.json"}
    assert {"repro.py", "README.md", "reprokit/replayer.py", "bundle/manifest.json", "bundle/run.json"} <= set(listed)
    code, d = _verify(out)
    assert code == 0 and d["ok"] and d["origin_checked"] is False and "origin not checked" in d["note"]


@pytest.mark.parametrize("offset", [-8, -5, -4, -1], ids=["crc_low", "crc_high", "isize_low", "isize_high"])
def test_flipped_gzip_trailer_byte_is_caught(nan_bundle, tmp_path, scratch, offset):
    out = _packed(nan_bundle, tmp_path)
    data = bytearray(out.read_bytes())
    data[offset] ^= 0x01
    out.write_bytes(bytes(data))
    code, d = _verify(out)
    assert code == 1 and any("not a readable .tar.gz" in p["problem"] for p in d["problems"]), d
    assert list(scratch.iterdir()) == []


def test_a_damaged_header_after_the_first_member_is_an_error_not_an_end(nan_bundle, tmp_path):
    bad = bytearray(_raw_member("mybundle/late.py", b"print('hi')\n"))
    bad[20] ^= 0x01  # a flipped bit in the name: its header checksum no longer matches
    archive = tmp_path / "b.tar.gz"
    archive.write_bytes(gzip.compress(_raw_bundle_tar(nan_bundle) + bytes(bad) + bytes(1024)))
    code, d = _verify(archive)
    assert code == 1 and any("header checksum mismatch" in p["problem"] for p in d["problems"]), d
    good = tmp_path / "good.tar.gz"  # the same archive, undamaged, is a valid hand-made bundle archive
    good.write_bytes(gzip.compress(_raw_bundle_tar(nan_bundle) + bytes(1024)))
    assert _verify(good)[0] == 0


def test_trailing_data_after_the_end_marker_is_refused(nan_bundle, tmp_path):
    archive = tmp_path / "b.tar.gz"
    archive.write_bytes(gzip.compress(_raw_bundle_tar(nan_bundle) + bytes(1024) + _raw_member("x/evil.py", b"1")))
    code, d = _verify(archive)
    assert code == 1 and any("after the tar end-of-archive marker" in p["problem"] for p in d["problems"]), d


def _repack(src: Path, dest: Path, edit) -> Path:
    """Extract ``src``, let ``edit(top)`` change files, tar it again (what someone re-packing by hand does)."""
    work = dest.parent / (dest.name + ".d")
    work.mkdir()
    with tarfile.open(src) as tf:
        tf.extractall(work, filter="data")
    (top,) = list(work.iterdir())
    edit(top)
    with tarfile.open(dest, "w:gz") as tf:
        tf.add(top, arcname=top.name)
    return dest


def _evil(top: Path) -> None:
    (top / "repro.py").write_text((top / "repro.py").read_text().replace("def main():", "def main():\n    pass"))


def _resign(top: Path) -> None:
    from reprokit.bundle import _self_digest

    pm = top / "pack-manifest.json"
    m = json.loads(pm.read_text())
    m["files"]["repro.py"] = {"sha256": B.sha256_file(top / "repro.py"), "size": (top / "repro.py").stat().st_size}
    m["self_sha256"] = _self_digest(m)
    pm.write_text(json.dumps(m))


def test_an_edited_repro_py_in_a_repacked_archive_is_caught(nan_bundle, tmp_path):
    out = _packed(nan_bundle, tmp_path, sidecar=True)
    edited = _repack(out, tmp_path / "edited.tar.gz", _evil)
    code, d = _verify(edited)
    assert code == 1 and {"file": "repro.py", "problem": "checksum mismatch (pack-manifest.json)"} == \
        {k: d["problems"][0][k] for k in ("file", "problem")}, d
    assert CliRunner().invoke(main, ["replay", str(edited)]).exit_code == 3

    dropped = _repack(out, tmp_path / "dropped.tar.gz", lambda top: (_evil(top), (top / "pack-manifest.json").unlink()))
    code, d = _verify(dropped)
    assert code == 1 and any(p["file"].endswith("/repro.py") and "not covered by any manifest" in p["problem"]
                             for p in d["problems"]), d

    # Re-signed consistently: the manifests cannot tell, but repro.py is not what this reprokit packs...
    resigned = _repack(out, tmp_path / "resigned.tar.gz", lambda top: (_evil(top), _resign(top)))
    code, d = _verify(resigned)
    assert code == 1 and [p["file"] for p in d["problems"]] == ["repro.py"], d
    assert "differs from what this reprokit" in d["problems"][0]["problem"]
    # ... accepted explicitly, it passes, with the note that its origin was not checked...
    human = CliRunner().invoke(main, ["verify", "--accept-generated", str(resigned)])
    assert human.exit_code == 0 and "origin not checked" in human.output and "accepted" in human.output, human.output
    # ... and the .sha256 the sender shipped catches it.
    (tmp_path / "resigned.tar.gz.sha256").write_bytes((out.parent / "repro.tar.gz.sha256").read_bytes())
    code, d = _verify(resigned)
    assert code == 1 and d["problems"][0]["problem"] == "archive sha256 does not match resigned.tar.gz.sha256"
    code, d = _verify(out)
    assert code == 0 and d["origin_checked"] and d["note"] is None


def test_corrupt_deflate_stream_is_a_clean_invalid_archive_error(tmp_path, scratch):
    archive = tmp_path / "bad.tar.gz"
    # A member whose data runs past the first gzip member into a second one that starts with a deflate
    # block of the reserved type 3: zlib.error, met while skipping data (where tarfile did not wrap it).
    info = tarfile.TarInfo("a/x.bin")
    info.size = 2 << 20
    corrupt = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + b"\x07" + bytes(64)
    archive.write_bytes(gzip.compress(info.tobuf(tarfile.GNU_FORMAT) + bytes(1 << 20)) + corrupt)
    with pytest.raises(zlib.error):  # the raw material
        gzip.decompress(corrupt)
    code, d = _verify(archive)
    assert code == 1 and "not a readable .tar.gz" in d["problems"][0]["problem"], d
    for cmd in ("replay", "inspect", "shrink"):
        extra = ["-o", str(tmp_path / "s")] if cmd == "shrink" else []
        r = CliRunner().invoke(main, [cmd, str(archive), *extra])
        assert r.exit_code == 3 and "not a readable .tar.gz" in r.output and isinstance(r.exception, SystemExit), \
            (cmd, r.output, r.exception)
    assert list(scratch.iterdir()) == []


def test_huge_sidecar_is_refused_unread(nan_bundle, tmp_path):
    import tracemalloc

    from reprokit.archive import check_digest

    out = _packed(nan_bundle, tmp_path)
    side = out.with_name(out.name + ".sha256")
    with open(side, "wb") as f:
        f.truncate(8 << 30)  # sparse: 8 GiB that take no disk
    tracemalloc.start()
    try:
        problems = check_digest(out, None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"read {peak} bytes of a sidecar that should have been refused unread"
    assert problems and "not a .sha256 file" in problems[0]["problem"], problems
    code, d = _verify(out)
    assert code == 1 and d["problems"][0]["file"] == "repro.tar.gz.sha256"
    side.write_text("not-a-digest  repro.tar.gz\n")
    assert "not a sha256" in _verify(out)[1]["problems"][0]["problem"]


def test_gnu_long_name_claiming_a_gib_is_refused_without_reading_it(nan_bundle, tmp_path, scratch):
    import time
    import tracemalloc

    from reprokit.archive import Limits, scan

    zeros = gzip.compress(bytes(64 << 20), compresslevel=9)  # one gzip member: 64 MiB of zeros
    name = b"mybundle-extra/" + b"a" * 100
    n = len(name) + 16 * (64 << 20)  # a long name of ~1 GiB, almost all NUL padding
    info = tarfile.TarInfo("././@LongLink")
    info.type, info.size = tarfile.GNUTYPE_LONGNAME, n
    head = _raw_bundle_tar(nan_bundle) + info.tobuf(tarfile.GNU_FORMAT) + name
    tail = bytes(-n % 512) + _raw_member("placeholder", b"x") + bytes(1024)
    archive = tmp_path / "longname.tar.gz"
    with open(archive, "wb") as f:
        f.write(gzip.compress(head))
        for _ in range(16):
            f.write(zeros)
        f.write(gzip.compress(tail))
    t0 = time.perf_counter()
    tracemalloc.start()
    try:
        problems = scan(archive, Limits())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 10
    assert peak < 16 << 20, f"{peak} bytes allocated for a header that must not be read"
    assert any("GNU long name of" in p["problem"] and "above max_header_bytes" in p["problem"] for p in problems), \
        problems
    code, d = _verify(archive)
    assert code == 1 and any("max_header_bytes" in p["problem"] for p in d["problems"])
    assert list(scratch.iterdir()) == []


def test_verify_exit_codes_are_the_documented_ones(nan_bundle, tmp_path):
    """0 ok, 1 problems (two bundles in one archive included), 3 a format newer than this reprokit."""
    two = tmp_path / "two.tar.gz"
    two.write_bytes(gzip.compress(_raw_bundle_tar(nan_bundle, "a") + _raw_bundle_tar(nan_bundle, "b") + bytes(1024)))
    code, d = _verify(two)
    assert code == 1 and "holds 2 bundles" in d["problems"][0]["problem"], d
    assert CliRunner().invoke(main, ["replay", str(two)]).exit_code == 3
    none = tmp_path / "none.tar.gz"
    none.write_bytes(gzip.compress(_raw_member("x/readme.txt", b"hi") + bytes(1024)))
    code, d = _verify(none)
    assert code == 1 and "holds 0 bundles" in d["problems"][0]["problem"], d
    m = json.loads((nan_bundle / "manifest.json").read_text())
    m["version"] = B.VERSION + 1
    (nan_bundle / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(main, ["verify", str(nan_bundle)])
    assert r.exit_code == 3 and "Upgrade reprokit" in r.output


@pytest.mark.slow
def test_a_bundle_tarred_without_a_top_folder_opens(nan_bundle, tmp_path):
    archive = tmp_path / "flat.tar.gz"
    archive.write_bytes(gzip.compress(_raw_member("./", b"", tarfile.DIRTYPE)
                                      + _raw_bundle_tar(nan_bundle, ".") + bytes(1024)))
    code, d = _verify(archive)
    assert code == 0 and d["ok"], d
    assert CliRunner().invoke(main, ["replay", str(archive)]).exit_code == 1
