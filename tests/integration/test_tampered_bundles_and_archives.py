"""Bundles and archives from other people, attacked where the checks used to end: files swapped after they were
verified (is what gets loaded the bytes that were hashed?), two spellings of one file, text that is not Unicode.

Each case is a real recorded bundle (or a real ``reprokit pack`` archive) altered the way a sender, or
someone who can write to the folder while reprokit reads it, would.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from rk_testing import reseal

from reprokit import archive
from reprokit import bundle as B
from reprokit.cli import main
from reprokit.errors import BundleError
from reprokit.pack import pack


def _step_json(bundle: Path) -> str:
    return sorted(p.relative_to(bundle).as_posix() for p in (bundle / "steps").glob("*.json"))[0]


def _edit(path: Path, key: str, value: object) -> None:
    doc = json.loads(path.read_text())
    doc[key] = value
    path.write_text(json.dumps(doc))


# --- a file swapped after verify ----------------------------------------------------------

@pytest.mark.parametrize("which", ["step", "state"])
def test_a_json_file_swapped_after_open_is_refused_not_loaded(nan_bundle, which):
    """open_bundle verifies every JSON file, but the step and state documents were read again later (replay reads
    them step by step), unchecked: an edit made meanwhile was loaded as if the sender had vouched for it."""
    b = B.open_bundle(nan_bundle)
    if which == "step":
        rel = _step_json(nan_bundle)
        _edit(nan_bundle / rel, "loss", 123.0)
        step = json.loads((nan_bundle / rel).read_text())["step"]
        with pytest.raises(BundleError, match=f"{rel}: size mismatch: it changed since the manifest was checked"):
            b.step(step)
    else:
        _edit(nan_bundle / B.STATE_JSON, "step", 99)
        with pytest.raises(BundleError, match="state/state.json: size mismatch"):
            b.state()


def test_inspect_batch_reads_the_step_json_it_was_vouched_for(nan_bundle):
    """``inspect --batch`` (report.step_batch) read the failing step's JSON again unchecked: a batch tree edited after
    the bundle was opened was shown as the recorded batch."""
    from reprokit.report import step_batch

    b = B.open_bundle(nan_bundle)
    step = b.failure.step
    rel = f"{B.STEPS}/{B.step_name(step)}.json"
    _edit(nan_bundle / rel, "loss", 123.0)
    with pytest.raises(BundleError, match=f"{rel}: size mismatch"):
        step_batch(b, step)


def test_a_same_size_edit_after_open_is_caught_by_its_digest(nan_bundle):
    b = B.open_bundle(nan_bundle)
    rel = _step_json(nan_bundle)
    text = (nan_bundle / rel).read_text()
    assert '"loss": ' in text
    i = text.index('"loss": ') + len('"loss": ')
    (nan_bundle / rel).write_text(text[:i] + ("7" if text[i] != "7" else "8") + text[i + 1:])  # one digit, same size
    with pytest.raises(BundleError, match="checksum mismatch") as e:
        b.step_doc(int(Path(rel).stem))
    assert e.value.problems[0]["file"] == rel


def test_a_fifo_swapped_in_after_open_is_refused_at_once(nan_bundle):
    """Reading a FIFO blocks until someone writes to it: a reader must refuse it unopened, not hang."""
    b = B.open_bundle(nan_bundle)
    rel = _step_json(nan_bundle)
    (nan_bundle / rel).unlink()
    os.mkfifo(nan_bundle / rel)

    done = threading.Event()

    def unblock() -> None:  # lets the old reader return (with nothing read) instead of hanging the test forever
        if done.wait(3):
            return
        try:
            fd = os.open(nan_bundle / rel, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass

    t = threading.Thread(target=unblock, daemon=True)
    t.start()
    start = time.monotonic()
    with pytest.raises(BundleError, match="not a regular file"):
        b.step_doc(int(Path(rel).stem))
    assert time.monotonic() - start < 2.5
    done.set()
    t.join()


def _overlapping(data: bytes) -> bytes:
    """The same safetensors file (same size) with one tensor's data range moved into a larger tensor's: two
    tensors reading the same bytes, a gap nothing reads."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    size = {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}
    for big in sorted(size):
        for small in sorted(size):
            if small == big or not 0 < size[small] <= size[big]:
                continue
            start = header[big]["data_offsets"][0]
            crafted = json.loads(json.dumps(header))
            crafted[small]["data_offsets"] = [start, start + size[small]]
            raw = json.dumps(crafted, separators=(",", ":")).encode()
            if len(raw) <= n:  # the same header length, so the same file size
                return struct.pack("<Q", n) + raw + b" " * (n - len(raw)) + data[8 + n:]
    raise AssertionError("no two tensors to overlap")


def test_a_safetensors_file_swapped_after_open_gets_the_checks_verify_made(nan_bundle):
    """A tensor file's header is checked when the bundle is opened (read, not hashed: hashing waits for the
    load), and its bytes are hashed when loaded. A sender who lists the digest of a second file with an
    overlapping header, and swaps it in once the first passed the checks, had it loaded: two tensors on the
    same bytes. The header of the bytes that hashed right is now held to the same checks."""
    rel = _step_json(nan_bundle).replace(".json", ".safetensors")
    honest = (nan_bundle / rel).read_bytes()
    crafted = _overlapping(honest)
    assert len(crafted) == len(honest)
    (nan_bundle / rel).write_bytes(crafted)
    reseal(nan_bundle)  # the manifest vouches for the crafted file
    (nan_bundle / rel).write_bytes(honest)  # ... but the honest one is there while the bundle is opened
    b = B.open_bundle(nan_bundle)
    (nan_bundle / rel).write_bytes(crafted)
    with pytest.raises(BundleError, match=f"{rel}: header: .*(overlapping|gap)"):
        b.step(int(Path(rel).stem))


def test_a_state_file_swapped_after_open_must_hold_the_tensors_the_tree_names(nan_bundle):
    """Swapped in after open, a state file (digest in the manifest, header well formed) lacking a tensor the
    state's tree names was loaded; restoring it then failed with a bare KeyError."""
    rel = B.STATE_TENSORS
    honest = (nan_bundle / rel).read_bytes()
    (n,) = struct.unpack("<Q", honest[:8])
    header = json.loads(honest[8:8 + n])
    victim = next(k for k in sorted(header) if k.startswith("model/"))
    header[victim.replace("model/", "modeX/", 1)] = header.pop(victim)  # same length, another name
    raw = json.dumps(header, separators=(",", ":")).encode()
    crafted = struct.pack("<Q", n) + raw + b" " * (n - len(raw)) + honest[8 + n:]
    (nan_bundle / rel).write_bytes(crafted)
    reseal(nan_bundle)
    (nan_bundle / rel).write_bytes(honest)
    b = B.open_bundle(nan_bundle)
    (nan_bundle / rel).write_bytes(crafted)
    with pytest.raises(BundleError, match="which is not in the file's tensors"):
        b.state()


# --- the manifest -------------------------------------------------------------------------

@pytest.mark.parametrize("alias", ["./run.json", "steps//{step}", "state/./state.json"])
def test_a_second_spelling_of_a_listed_file_is_a_problem(nan_bundle, alias):
    """The manifest listed one file twice, under two spellings, and verify called the bundle intact."""
    step = Path(_step_json(nan_bundle)).name
    alias = alias.format(step=step)
    canonical = "/".join(p for p in alias.split("/") if p not in ("", "."))

    def add(m: dict) -> None:
        m["files"][alias] = dict(m["files"][canonical])

    reseal(nan_bundle, add)
    problems = B.verify(nan_bundle)
    assert problems == [{"file": alias, "problem": "not a plain path in the manifest (an empty or '.' part): each "
                                                   "file is listed once, by one spelling"}]
    r = CliRunner().invoke(main, ["replay", str(nan_bundle)])
    assert r.exit_code == 3 and alias in r.output, r.output


def test_a_listed_file_that_is_a_link_is_reported_once(nan_bundle, tmp_path):
    outside = tmp_path / "outside.json"
    shutil.copyfile(nan_bundle / B.ENV, outside)
    (nan_bundle / B.ENV).unlink()
    (nan_bundle / B.ENV).symlink_to(outside)
    assert B.verify(nan_bundle) == [{"file": B.ENV, "problem": "a link, not a file (a bundle holds regular files only)"}]


def test_a_manifest_path_that_is_not_unicode_is_a_problem_not_a_crash(nan_bundle):
    """A JSON escape like \\udcff makes a string no file system can take: verify died in a UnicodeEncodeError
    (exit 70, 'internal error') instead of refusing the bundle."""
    def add(m: dict) -> None:
        m["files"]["code/\udcff.py"] = {"sha256": "0" * 64, "size": 0}

    reseal(nan_bundle, add)
    problems = B.verify(nan_bundle)
    assert len(problems) == 1 and problems[0]["file"] == B.MANIFEST
    assert "unpaired surrogate" in problems[0]["problem"]
    for cmd in ("inspect", "replay"):
        r = CliRunner().invoke(main, [cmd, str(nan_bundle)])
        assert r.exit_code == 3 and "unpaired surrogate" in r.output, (cmd, r.output)


def test_a_failure_message_that_is_not_unicode_is_refused_not_printed(nan_bundle):
    """inspect and replay printed failure.json's message and died in a UnicodeEncodeError (exit 70)."""
    _edit(nan_bundle / B.FAILURE, "message", "bad \ud800 name")
    reseal(nan_bundle)
    for cmd in ("inspect", "replay"):
        r = CliRunner().invoke(main, [cmd, str(nan_bundle)])
        assert r.exit_code == 3 and "failure.json: message holds a string with an unpaired surrogate" in r.output, \
            (cmd, r.output)


# --- an archive swapped after its sha256 was checked ---------------------------------------

def test_an_archive_swapped_after_its_digest_was_checked_is_refused(shared_nan_bundle, tmp_path, monkeypatch):
    """The archive's sha256 (--sha256 or the sidecar) was checked on one read, and the file extracted on two
    later reads: an archive rewritten in between (a download still in progress, a shared inbox) was extracted
    and opened as if it were the one whose digest the user vouched for."""
    good = pack(shared_nan_bundle, tmp_path / "good.tar")
    other = Path(shutil.copytree(shared_nan_bundle, tmp_path / "other" / shared_nan_bundle.name))
    _edit(other / B.RUN, "config", {"lr": 1e9})
    reseal(other)  # a valid bundle of its own, with a valid archive of its own
    pack(other, tmp_path / "other.tar")
    scan = archive.scan

    def scan_then_swap(path: Path, limits: archive.Limits) -> list:
        found = scan(path, limits)
        shutil.copyfile(tmp_path / "other.tar", path)  # after the digest and the pre-scan, before extraction
        return found

    monkeypatch.setattr(archive, "scan", scan_then_swap)
    with pytest.raises(BundleError, match="the archive changed after its sha256 was checked") as e:
        with archive.extracted(tmp_path / "good.tar", sha256=good.sha256):
            pass
    assert good.sha256 in str(e.value)
    shutil.copyfile(tmp_path / "good.tar.sha256", tmp_path / "other.tar.sha256")  # the sidecar is the anchor
    with pytest.raises(BundleError, match="archive sha256 does not match other.tar.sha256"):
        with archive.extracted(tmp_path / "other.tar"):
            pass


def test_an_unswapped_archive_still_opens_with_and_without_a_digest(shared_nan_bundle, tmp_path):
    res = pack(shared_nan_bundle, tmp_path / "repro.tar")
    with archive.extracted(tmp_path / "repro.tar", sha256=res.sha256) as b:
        assert B.open_bundle(b).failure.kind == "nonfinite_loss"
    (tmp_path / "repro.tar.sha256").unlink()
    with archive.extracted(tmp_path / "repro.tar") as b:
        assert B.verify(b) == []


# --- a safetensors header that lies about shapes ------------------------------------------

def _with_shape(data: bytes, shape: list[int]) -> bytes:
    """The file with its first tensor's shape replaced (its data range unchanged)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    first = sorted(k for k in header if k != "__metadata__")[0]
    header[first]["shape"] = shape
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data[8 + n:]


@pytest.mark.parametrize(("shape", "words"), [
    ([2 ** 62] * 64, "needs more bytes than the whole"),
    ([2 ** 62] * 3000, "has 3000 dimensions; at most 64"),
    ([2 ** 62] * 40000, "has 40000 dimensions; at most 64"),
], ids=["huge dimensions", "thousands of dimensions", "tens of thousands of dimensions"])
def test_a_header_with_absurd_dimensions_is_refused_quickly(nan_bundle, shape, words):
    """The element count was multiplied out over every dimension before being compared with the data: 3,000
    dimensions of 2**62 made a 55,000-digit number whose error message could not even be formatted (a bare
    ValueError, exit 70), and 40,000 of them took 9 s (quadratic: a 64 MiB header, hours)."""
    rel = _step_json(nan_bundle).replace(".json", ".safetensors")
    (nan_bundle / rel).write_bytes(_with_shape((nan_bundle / rel).read_bytes(), shape))
    reseal(nan_bundle)
    start = time.monotonic()
    problems = B.verify(nan_bundle)
    assert time.monotonic() - start < 3
    assert [p["file"] for p in problems] == [rel] and words in problems[0]["problem"], problems
    r = CliRunner().invoke(main, ["replay", str(nan_bundle)])
    assert r.exit_code == 3 and rel in r.output and words in r.output, r.output


# --- pack ships what was verified ----------------------------------------------------------

def test_pack_ships_only_the_files_the_verified_manifest_lists(nan_bundle, tmp_path):
    """pack verified the bundle, then packed whatever the folder held by then, links followed: a link to a
    private file, dropped into the folder meanwhile, was shipped inside the archive (and listed in its pack
    manifest as if it belonged)."""
    import tarfile

    from reprokit.pack import _pack

    token = uuid.uuid4().hex.encode()  # in no other file (env.json may hold this very test in a git diff)
    secret = tmp_path / "id_rsa"
    secret.write_bytes(token)
    b = B.open_bundle(nan_bundle)
    (nan_bundle / "code" / "notes.txt").symlink_to(secret)
    (nan_bundle / "extra.json").write_text("{}")
    res = _pack(b, tmp_path / "repro.tar")
    with tarfile.open(res.output) as tf:
        names = {m.name.split("/", 2)[-1] for m in tf.getmembers() if m.isfile() and m.name.split("/")[1] == "bundle"}
        leaked = [m.name for m in tf.getmembers() if m.isfile() and token in tf.extractfile(m).read()]
    assert leaked == []
    assert names == {*b.manifest["files"], B.MANIFEST}
    shutil.rmtree(nan_bundle / "code")  # what is packed opens, intact, elsewhere
    r = CliRunner().invoke(main, ["verify", str(res.output)])
    assert r.exit_code == 0, r.output


# --- folders nested a thousand deep -----------------------------------------------------------

DEEP = 1200  # past Python's recursion limit; "d/" * 1200 stays well inside PATH_MAX


def _remove_tree(root: Path) -> None:
    """shutil.rmtree (and pytest's tmp_path cleanup with it) recurses once per level: remove a deep tree without."""
    stack, order = [root], []
    while stack:
        d = stack.pop()
        order.append(d)
        for e in os.scandir(d):
            if e.is_dir(follow_symlinks=False):
                stack.append(Path(e.path))
            else:
                os.unlink(e.path)
    for d in reversed(order):
        os.rmdir(d)


def test_a_bundle_folder_nesting_a_thousand_folders_is_a_problem_not_a_crash(nan_bundle):
    """verify walked the folder with Path.rglob, one recursion per level: RecursionError, exit 70."""
    d = nan_bundle / "d"
    d.mkdir()
    here = os.getcwd()
    try:
        os.chdir(d)
        for _ in range(DEEP - 1):
            os.mkdir("d")
            os.chdir("d")
        Path("x").write_text("x")
    finally:
        os.chdir(here)
    try:
        problems = B.verify(nan_bundle)
        assert [p["problem"] for p in problems] == ["unexpected file"]
        assert problems[0]["file"] == "d/" * DEEP + "x"
        r = CliRunner().invoke(main, ["replay", str(nan_bundle)])
        assert r.exit_code == 3 and "unexpected file" in r.output, r.output
    finally:
        _remove_tree(d)


def test_an_archive_member_nested_a_thousand_deep_is_refused_before_anything_is_written(shared_nan_bundle, tmp_path,
                                                                                         monkeypatch):
    """Extracted, such a tree made shutil.rmtree of the temp dir die in a RecursionError (exit 70), leaving
    the extracted files behind."""
    import io
    import tarfile
    import tempfile

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "deep.tar"
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(shared_nan_bundle, arcname="b")
        info = tarfile.TarInfo("b/" + "d/" * DEEP + "x")
        info.size = 1
        tf.addfile(info, io.BytesIO(b"x"))
    try:
        r = CliRunner().invoke(main, ["replay", str(out)])
        assert r.exit_code == 3 and f"path nests {DEEP + 2} names deep; at most 128" in r.output, r.output
        assert "nothing was written" in r.output
        assert list(scratch.iterdir()) == []
    finally:
        for left in scratch.iterdir():
            _remove_tree(left) if left.is_dir() and not left.is_symlink() else left.unlink()


@pytest.mark.parametrize("subdir", ["../../elsewhere", "/home/someone/project", "a/../../b"])
def test_a_code_subdir_outside_the_repository_is_refused(nan_bundle, subdir):
    """env.json's git.code_subdir is where commit bisection imports the project from in each checked-out commit
    (``<worktree>/<code_subdir>``, replayed with --code): one with '..' or an absolute path pointed it at any
    folder of the machine, chosen by the bundle."""
    doc = json.loads((nan_bundle / B.ENV).read_text())
    doc["git"] = {**(doc.get("git") or {}), "code_subdir": subdir}
    (nan_bundle / B.ENV).write_text(json.dumps(doc))
    reseal(nan_bundle)
    problems = B.verify(nan_bundle)
    assert problems == [{"file": B.ENV, "problem": "git.code_subdir must be a folder inside the repository "
                                                   f"(relative, no '..'), got {subdir!r}"}]


def test_a_recorded_rng_state_the_generator_refuses_is_an_invalid_bundle(nan_bundle):
    """A schema-valid RNG tensor of the wrong size (re-signed) made replay die in torch's RuntimeError (exit 70)."""
    import torch

    from reprokit.bundle import tensorfile

    meta = json.loads((nan_bundle / B.MANIFEST).read_text())["files"][B.STATE_TENSORS]
    tensors = dict(tensorfile.read_verified(nan_bundle / B.STATE_TENSORS, meta["sha256"], meta["size"]))
    tensors["rng/torch"] = torch.zeros(10, dtype=torch.uint8)
    tensorfile.write_safetensors(nan_bundle / B.STATE_TENSORS, tensors)
    reseal(nan_bundle)
    assert B.verify(nan_bundle) == []
    r = CliRunner().invoke(main, ["replay", str(nan_bundle)])
    assert r.exit_code == 3 and "recorded state of the global generators cannot be set" in r.output, r.output


# --- code that is not the source it shows ----------------------------------------------------

def _hidden_bytecode(bundle: Path) -> str:
    """An unchecked-hash .pyc of a changed rk_mlp.py in code/__pycache__, listed in the re-signed manifest; the
    visible code/rk_mlp.py is untouched. Python imports such a .pyc without looking at the source."""
    import py_compile
    import sys

    changed = bundle.parent / "rk_mlp_changed.py"
    changed.write_text((bundle / "code" / "rk_mlp.py").read_text() + "\nprint('HIDDEN BYTECODE RAN')\n")
    rel = f"code/__pycache__/rk_mlp.{sys.implementation.cache_tag}.pyc"
    (bundle / rel).parent.mkdir()
    py_compile.compile(str(changed), cfile=str(bundle / rel), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)

    def add(m: dict) -> None:
        m["files"][rel] = {"sha256": B.sha256_file(bundle / rel), "size": (bundle / rel).stat().st_size}

    reseal(bundle, add)
    return rel


def test_bytecode_hidden_in_the_code_snapshot_never_runs(nan_bundle):
    """Replay ran the hidden bytecode, not the code/rk_mlp.py a reader would check, and verify called the bundle
    intact."""
    rel = _hidden_bytecode(nan_bundle)
    problems = B.verify(nan_bundle)
    assert [p["file"] for p in problems] == [rel] and "not Python source" in problems[0]["problem"]
    r = CliRunner().invoke(main, ["replay", str(nan_bundle)])
    assert r.exit_code == 3 and "HIDDEN BYTECODE RAN" not in r.output, r.output


@pytest.mark.parametrize("name", ["helper.cpython-311-x86_64-linux-gnu.so", "notes.txt"])
def test_a_code_snapshot_holds_python_source_only(nan_bundle, name):
    (nan_bundle / "code" / name).write_bytes(b"\x7fELF")
    reseal(nan_bundle, lambda m: m["files"].update({f"code/{name}": {"sha256": B.sha256_file(nan_bundle / "code" / name),
                                                                 "size": 4}}))
    assert [p["file"] for p in B.verify(nan_bundle)] == [f"code/{name}"]


def test_an_archive_carrying_bytecode_is_refused_before_anything_is_written(shared_nan_bundle, tmp_path):
    """The vendored runtime that `python repro.py` imports, or the snapshot, could carry a .pyc run in place of
    the source beside it."""
    import io
    import tarfile

    out = tmp_path / "repro.tar"
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(shared_nan_bundle, arcname="b")
        info = tarfile.TarInfo("reprokit/__pycache__/bundle.cpython-311.pyc")
        info.size = 4
        tf.addfile(info, io.BytesIO(b"\x00" * 4))
    r = CliRunner().invoke(main, ["verify", str(out)])
    assert r.exit_code == 1 and "compiled or native code not allowed" in r.output, r.output


def test_pack_never_writes_through_a_link_planted_at_its_temp_name(shared_nan_bundle, tmp_path):
    """pack wrote the archive to '.OUT.tmp-PID' with a plain open(): in a shared folder (/tmp), a link planted
    there by someone else had the archive written through it, over the file it points to."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    shared = tmp_path / "shared"
    shared.mkdir()
    for name in ("repro.tar", "repro.tar.sha256"):
        (shared / f".{name}.tmp-{os.getpid()}").symlink_to(victim)
    res = pack(shared_nan_bundle, shared / "repro.tar")
    assert victim.read_text() == "precious"
    assert B.sha256_file(res.output) == res.sha256 and not res.output.is_symlink()
    assert (shared / "repro.tar.sha256").read_text().startswith(res.sha256)
