"""Files reprokit generates are what this reprokit writes, and a bundle holds nothing beyond its layout.

A re-signed manifest proves consistency, not authorship: a swapped ``extract/op_repro.py`` (which the user is told to
run) or an archive's ``repro.py`` passed ``verify`` and ``pack``. Each case is a real extract of rk_extract_zoo (the
module UnstableSoftmax, with its one-op repro) or a real packed rk_mlp bundle, edited and re-signed.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from rk_testing import bundle_of, cli, record, reseal

from reprokit import bundle as B
from reprokit import generated
from reprokit.errors import BundleError
from reprokit.extract import extract
from reprokit.pack import PACK_MANIFEST, pack

EVIL = "import os\nos.system('echo pwned')\n"


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    from conftest import PROJECTS

    tmp = tmp_path_factory.mktemp("extract")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(PROJECTS))
        m = importlib.import_module("rk_extract_zoo")
        _, exc = record(m, {}, m.batches({}, 6, poison_step=4), tmp / "repros", snapshot_every=3)
        return extract(B.open_bundle(bundle_of(exc)), tmp / "extract").output


@pytest.fixture
def ext(extracted, tmp_path):
    return Path(shutil.copytree(extracted, tmp_path / "extract"))


def swap(bundle: Path, rel: str, text: str, manifest_edit: Callable[[dict], object] | None = None) -> None:
    (bundle / rel).write_text(text)
    reseal(bundle, manifest_edit)


def test_a_genuine_extract_verifies_and_packs(ext, tmp_path):
    assert B.verify(ext) == []
    assert cli("pack", str(ext), "-o", str(tmp_path / "r.tar")).exit_code == 0
    assert cli("verify", str(tmp_path / "r.tar")).exit_code == 0


@pytest.mark.parametrize("rel", [generated.OP_REPRO, generated.EXTRACT_STEP])
def test_a_swapped_generated_file_is_a_verify_problem_and_pack_refuses_it(ext, tmp_path, rel):
    swap(ext, rel, EVIL)
    problems = B.verify(ext)
    assert [p["file"] for p in problems] == [rel], problems
    assert "differs from what this reprokit" in problems[0]["problem"] and "edited after" in problems[0]["problem"]
    v = cli("verify", str(ext))
    assert v.exit_code == 1 and rel in v.output and "--accept-generated" in v.output, v.output
    p = cli("pack", str(ext), "-o", str(tmp_path / "r.tar"))
    assert p.exit_code == 3 and rel in p.output and not (tmp_path / "r.tar").exists(), p.output
    r = cli("replay", str(ext))
    assert r.exit_code == 3 and rel in r.output, r.output
    with pytest.raises(BundleError, match="differs from what this reprokit"):
        pack(ext, tmp_path / "r.tar")


def test_accept_generated_is_explicit_and_lists_what_it_accepted(ext, tmp_path):
    swap(ext, generated.OP_REPRO, EVIL)
    v = cli("verify", "--accept-generated", "--json", str(ext))
    doc = json.loads(v.stdout)
    assert v.exit_code == 0 and doc["ok"] and [a["file"] for a in doc["accepted"]] == [generated.OP_REPRO], doc
    assert "accepted (--accept-generated) extract/op_repro.py" in cli("verify", "--accept-generated", str(ext)).output
    assert cli("pack", "--accept-generated", str(ext), "-o", str(tmp_path / "r.tar")).exit_code == 0
    with generated.accepting():
        assert B.verify(ext) == []
    assert B.verify(ext) != [], "accepting() ends with its block"


def test_a_generated_file_of_another_version_names_that_version(ext, monkeypatch):
    swap(ext, generated.EXTRACT_STEP, "# rk_extract.py as reprokit 0.0.9 wrote it\n",
         lambda m: m.__setitem__("reprokit_version", "0.0.9"))
    (p,) = B.verify(ext)
    assert "written by reprokit 0.0.9" in p["problem"], p
    # A file an earlier build of this version wrote, known by digest: said so, still not accepted unasked.
    known = hashlib.sha256((ext / generated.EXTRACT_STEP).read_bytes()).hexdigest()
    monkeypatch.setitem(generated.EARLIER, known, "extract before class refs were vetted (2026-11-26)")
    (p,) = B.verify(ext)
    assert "an earlier reprokit build wrote (extract before class refs were vetted" in p["problem"], p


@pytest.mark.parametrize("rel", ["notes.txt", "extract/run_me.sh", "state/extra.safetensors", "steps/evil.py"])
def test_a_listed_file_beyond_the_bundle_layout_is_a_verify_problem(ext, rel):
    (ext / rel).write_text("hello\n")
    reseal(ext, lambda m: m["files"].__setitem__(rel, {"sha256": "0" * 64, "size": 0}))
    reseal(ext)  # now with the file's real digest
    problems = B.verify(ext)
    assert any(p["file"] == rel and "not part of the bundle layout" in p["problem"] for p in problems), problems
    v = cli("verify", str(ext))
    assert v.exit_code == 1 and rel in v.output, v.output


def test_an_unlisted_file_is_listed_by_verify(ext):
    (ext / "extract" / "run_me.sh").write_text("rm -rf ~\n")
    problems = B.verify(ext)
    assert {"file": "extract/run_me.sh", "problem": "unexpected file"} in problems, problems


# --- packed archives: repro.py, README.md, the vendored runtime ---------------------------------------------------

@pytest.fixture(scope="module")
def packed(shared_nan_bundle, tmp_path_factory):
    return pack(shared_nan_bundle, tmp_path_factory.mktemp("packed") / "repro.tar").output


def repack(tar: Path, out: Path, edit: Callable[[Path], object]) -> Path:
    """Unpack ``tar``, ``edit(top)``, re-sign its pack manifest (as a sender could) and tar it again as ``out``."""
    work = out.parent / "unpacked"
    with tarfile.open(tar) as tf:
        tf.extractall(work, filter="data")
    (top,) = work.iterdir()
    edit(top)
    pm = json.loads((top / PACK_MANIFEST).read_text())
    pm["files"] = {p.relative_to(top).as_posix(): {"sha256": B.sha256_file(p), "size": p.stat().st_size}
                   for p in sorted(top.rglob("*")) if p.is_file() and p.name != PACK_MANIFEST}
    pm["self_sha256"] = B._self_digest(pm)
    (top / PACK_MANIFEST).write_text(json.dumps(pm))
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        tf.add(top, arcname=top.name)
    shutil.rmtree(work)
    return out


def test_a_genuine_archive_verifies(packed, tmp_path):
    assert cli("verify", str(packed)).exit_code == 0
    same = repack(packed, tmp_path / "same.tar", lambda top: None)  # re-tarred, files unchanged
    assert cli("verify", str(same)).exit_code == 0


@pytest.mark.parametrize("rel", ["repro.py", "README.md", "reprokit/replayer.py"])
def test_a_swapped_file_beside_the_bundle_is_a_problem(packed, tmp_path, rel):
    tar = repack(packed, tmp_path / "r.tar", lambda top: (top / rel).write_text(EVIL))
    v = cli("verify", "--json", str(tar))
    doc = json.loads(v.stdout)
    assert v.exit_code == 1 and [p["file"] for p in doc["problems"]] == [rel], doc
    assert "differs from what this reprokit" in doc["problems"][0]["problem"]
    r = cli("replay", str(tar))
    assert r.exit_code == 3 and rel in r.output, r.output
    assert cli("verify", "--accept-generated", str(tar)).exit_code == 0


def test_an_archive_packed_by_another_version_names_it(packed, tmp_path):
    def older(top: Path) -> None:
        (top / "reprokit" / "_version.py").write_text('__version__ = "0.0.9"\n')
        (top / "reprokit" / "old_module.py").write_text("x = 1\n")

    tar = repack(packed, tmp_path / "r.tar", older)
    doc = json.loads(cli("verify", "--json", str(tar)).stdout)
    got = {p["file"]: p["problem"] for p in doc["problems"]}
    assert set(got) == {"reprokit/_version.py", "reprokit/old_module.py"}, got
    assert "written by reprokit 0.0.9" in got["reprokit/_version.py"], got
    assert "not a file reprokit pack writes" in got["reprokit/old_module.py"] and "0.0.9" in got["reprokit/old_module.py"]
