"""``run.json``'s refs may only name the code replay runs: the bundle's snapshot, ``--code``, or the demo.

Each hostile bundle is a real recorded bundle whose ``run.json`` was edited and whose manifest
was re-signed, as an attacker would: checksums alone cannot catch it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from rk_testing import cli, entries

import reprokit
from reprokit import bundle as B
from reprokit.cli import main
from reprokit.pack import pack

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DEMO = ROOT / "tests" / "golden" / "v1" / "demo-nan"


def reseal(bundle: Path, edit_run=None, add: dict[str, str] | None = None) -> None:
    """Edit run.json and/or add files, then re-sign the manifest so the bundle verifies again."""
    m = json.loads((bundle / B.MANIFEST).read_text())
    if edit_run is not None:
        run = json.loads((bundle / B.RUN).read_text())
        edit_run(run)
        (bundle / B.RUN).write_text(json.dumps(run))
    for rel, text in (add or {}).items():
        (bundle / rel).parent.mkdir(parents=True, exist_ok=True)
        (bundle / rel).write_text(text)
    for rel in [B.RUN, *(add or {})]:
        m["files"][rel] = {"sha256": B.sha256_file(bundle / rel), "size": (bundle / rel).stat().st_size}
    m["self_sha256"] = B._self_digest(m)
    (bundle / B.MANIFEST).write_text(json.dumps(m))
    # Checksums alone cannot catch it: only run.json's refs (their shape, in verify) can stop it.
    assert all(p["file"] == B.RUN and p["problem"].startswith("refs") for p in B.verify(bundle))


def set_ref(role: str, ref, config=None):
    def edit(run):
        if role == "predicates":
            run["refs"]["predicates"] = [ref]
        else:
            run["refs"][role] = ref
        if config is not None:
            run["config"] = config
    return edit


def checkout_of(bundle: Path, dest: Path, append: str = "") -> Path:
    shutil.copytree(bundle / "code", dest)
    if append:
        with open(dest / "rk_mlp.py", "a") as fh:
            fh.write(append)
    return dest


@pytest.mark.parametrize("with_code", [False, True])
def test_os_system_ref_runs_nothing_and_exits_3(nan_bundle, tmp_path, with_code):
    marker = tmp_path / "MARKER"
    reseal(nan_bundle, set_ref("build", {"module": "os", "qualname": "system"}, config=f"touch {marker}"))
    extra = ["--code", str(checkout_of(nan_bundle, tmp_path / "checkout"))] if with_code else []
    r = cli("replay", str(nan_bundle), *extra)
    assert not marker.exists(), "os.system ran"
    assert r.exit_code == 3, r.output
    assert "run.json: refs.build = os:system" in r.output and "the standard library" in r.output


@pytest.mark.parametrize("with_code", [False, True])
def test_script_ref_outside_the_bundle_runs_nothing(nan_bundle, tmp_path, with_code):
    marker = tmp_path / "MARKER"
    evil = tmp_path / "x.py"
    evil.write_text(f"import pathlib; pathlib.Path({str(marker)!r}).write_text('pwned')\n"
                    "def build(config):\n    return None\n")
    code = checkout_of(nan_bundle, tmp_path / "a" / "b" / "checkout") if with_code else nan_bundle / "code"
    rel = os.path.relpath(evil, code)
    assert rel.startswith("../")
    reseal(nan_bundle, set_ref("build", {"script": rel, "qualname": "build"}))
    r = cli("replay", str(nan_bundle), *(["--code", str(code)] if with_code else []))
    assert not marker.exists(), "a script outside the bundle ran"
    assert r.exit_code == 3, r.output
    assert "refs.build" in r.output and "'..'" in r.output


def test_module_outside_the_snapshot_is_not_imported(nan_bundle, tmp_path, monkeypatch):
    """A module found elsewhere on the import path is not the bundle's code."""
    marker = tmp_path / "MARKER"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rk_evil.py").write_text(f"import pathlib; pathlib.Path({str(marker)!r}).write_text('pwned')\n"
                                          "def check(*args):\n    return None\n")
    reseal(nan_bundle, set_ref("predicates", {"module": "rk_evil", "qualname": "check"}))
    monkeypatch.syspath_prepend(str(elsewhere))
    r = cli("replay", str(nan_bundle))
    assert not marker.exists(), "a module outside the bundle was imported"
    assert r.exit_code == 3, r.output
    assert "refs.predicates[0] = rk_evil:check" in r.output and "not in the bundle's code snapshot" in r.output


def test_attribute_chain_to_a_foreign_function_is_refused(nan_bundle, tmp_path):
    """``rk_mlp:os.system`` resolves through the project's module to os.system: refused, never called."""
    marker = tmp_path / "MARKER"
    code = checkout_of(nan_bundle, tmp_path / "checkout", append="\nimport os  # noqa\n")
    reseal(nan_bundle, set_ref("build", {"module": "rk_mlp", "qualname": "os.system"}, config=f"touch {marker}"))
    r = cli("replay", str(nan_bundle), "--code", str(code), *entries(nan_bundle))
    assert not marker.exists()
    assert r.exit_code == 3, r.output
    assert "refs.build = rk_mlp:os.system names an object defined in" in r.output


@pytest.mark.parametrize("ref,why", [
    ({"module": "rk_mlp", "qualname": "build; import os"}, "qualname must be dotted Python identifiers"),
    ({"module": "rk_mlp", "qualname": "__builtins__.exec"}, "qualname must be dotted Python identifiers"),
    ({"module": "../rk_mlp", "qualname": "build"}, "module must be dotted Python identifiers"),
    ({"script": "/tmp/x.py", "qualname": "build"}, "script must be a relative path"),
    ({"script": "rk_mlp.py", "module": "rk_mlp", "qualname": "build"}, "must be {"),
    ({"module": "reprokit.cli", "qualname": "main"}, "of reprokit, refs may only name reprokit.demo"),
    ({"module": "torch", "qualname": "save"}, "an installed package"),
    ("rk_mlp:build", "must be {"),
])
def test_malformed_or_foreign_refs_are_invalid_bundles(nan_bundle, ref, why):
    reseal(nan_bundle, set_ref("step", ref))
    with pytest.raises(reprokit.BundleError, match="refs.step") as e:
        reprokit.replay(nan_bundle)
    assert why in str(e.value) and e.value.exit_code == 3


@pytest.mark.parametrize("planted,name,owner", [("code/json.py", "json", "the standard library"),
                                                 ("code/torch/__init__.py", "torch", "an installed package")])
def test_snapshot_shadowing_an_installed_module_is_refused(nan_bundle, tmp_path, planted, name, owner):
    marker = tmp_path / "MARKER"
    reseal(nan_bundle, add={planted: f"import pathlib; pathlib.Path({str(marker)!r}).write_text('x')\n"})
    r = cli("replay", str(nan_bundle), "--json")
    assert not marker.exists()
    assert r.exit_code == 3, r.output
    assert f"which would shadow {name} of {owner}" in r.output


def test_bundle_without_snapshot_needs_a_code_folder(nan_bundle, tmp_path):
    """No code/ (the project was imported from site-packages when recorded): only --code can supply it."""
    code = checkout_of(nan_bundle, tmp_path / "checkout")
    shutil.rmtree(nan_bundle / "code")
    m = json.loads((nan_bundle / B.MANIFEST).read_text())
    m["files"] = {k: v for k, v in m["files"].items() if not k.startswith("code/")}
    m["self_sha256"] = B._self_digest(m)
    (nan_bundle / B.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(reprokit.BundleError, match="has no code snapshot.*Pass --code DIR"):
        reprokit.replay(nan_bundle)
    assert reprokit.replay(nan_bundle, code=code).reproduced


def test_code_folder_module_linked_from_outside_is_not_imported(nan_bundle, tmp_path):
    marker = tmp_path / "MARKER"
    outside = tmp_path / "outside.py"
    outside.write_text(f"import pathlib; pathlib.Path({str(marker)!r}).write_text('x')\n")
    code = checkout_of(nan_bundle, tmp_path / "checkout")
    (code / "rk_mlp.py").unlink()
    (code / "rk_mlp.py").symlink_to(outside)
    r = cli("replay", str(nan_bundle), "--code", str(code))
    assert not marker.exists()
    assert r.exit_code == 125 and "does not hold the bundle's code" in r.output, r.output


def test_code_folder_without_the_project_exits_125(nan_bundle, tmp_path, projects):
    """An empty --code folder must not replay the installed module while saying "code from DIR"."""
    projects("rk_mlp")  # the live copy is importable: it must not stand in for the checkout
    empty = tmp_path / "empty"
    empty.mkdir()
    result = CliRunner().invoke(main, ["replay", str(nan_bundle), "--code", str(empty)])
    assert result.exit_code == 125, result.output
    assert f"--code {empty} does not hold the bundle's code: no rk_mlp/__init__.py or rk_mlp.py" in result.output


@pytest.mark.slow
def test_valid_checkout_and_snapshot_still_replay(nan_bundle, tmp_path):
    assert reprokit.replay(nan_bundle).reproduced
    code = checkout_of(nan_bundle, tmp_path / "checkout", append="\nimport os  # noqa\n")
    (code / "test").mkdir()  # a checkout may hold a folder named like a stdlib package
    report = reprokit.replay(nan_bundle, code=code)
    assert report.reproduced and report.code == str(code.resolve())


def test_demo_bundle_replays_and_refuses_a_code_folder(tmp_path):
    demo = tmp_path / "demo"
    shutil.copytree(GOLDEN_DEMO, demo)
    assert reprokit.replay(demo).reproduced
    with pytest.raises(reprokit.CodeLoadError, match="reprokit's own .*drop --code"):
        reprokit.replay(demo, code=tmp_path)


@pytest.mark.slow
def test_packed_demo_replays_with_the_vendored_runtime(tmp_path):
    out = tmp_path / "demo.tar.gz"
    pack(GOLDEN_DEMO, out)
    with tarfile.open(out) as tf:
        tf.extractall(tmp_path / "x", filter="data")
    (top,) = list((tmp_path / "x").iterdir())
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(top / "repro.py"), "--json"], capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["verdict"] == "deterministic"


def test_inspect_shows_the_refs(nan_bundle):
    result = CliRunner().invoke(main, ["inspect", str(nan_bundle)])
    assert result.exit_code == 0, result.output
    assert "refs     build rk_mlp:build, step rk_mlp:train_step" in result.output
