"""`reprokit extract`: the failing module alone, as a small bundle that replays anywhere."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import textwrap

import pytest
from rk_forked import hand_off_env
from rk_testing import bundle_of, cli, record

from reprokit.pack import pack


@pytest.fixture
def bare_server():
    """The hand-off runs' fork server (:func:`rk_forked.shared_bare`): ``python -S`` with only torch, numpy and
    safetensors (a minimal site) on its path, torch imported once; each run is a process forked from it that imports
    what a fresh ``python -S`` process with that environment could, and nothing more
    (test_a_hand_off_run_has_the_import_path_of_a_fresh_python_s_process)."""
    from rk_forked import shared_bare

    return shared_bare()


def _record(projects, tmp_path, case):
    if case != "embedding":
        m, cfg = projects("rk_extract_zoo"), {} if case == "softmax" else {"model": case}
        batches = m.batches(cfg, 6, poison_step=4)
    else:
        m, cfg = projects("rk_lm"), {"vocab": 64, "max_len": 32}
        batches = m.batches(cfg, 6, oov_step=4)
    _, exc = record(m, cfg, batches, tmp_path / "repros", snapshot_every=3)
    return bundle_of(exc)


def _unpacked(tmp_path, packed):
    """The folder an archive unpacks to, as a colleague would open it (the ``data`` filter)."""
    unpacked = tmp_path / "colleague"
    unpacked.mkdir()
    with tarfile.open(packed) as tf:
        tf.extractall(unpacked, filter="data")
    (top,) = list(unpacked.iterdir())
    return top


def _hand_off(tmp_path, server, folder, script, *args):
    """Run ``script`` (relative to the unpacked folder) from another folder with only torch, numpy and safetensors
    importable: forked from the ``bare_server``, as ``python -S script`` with :func:`rk_forked.hand_off_env` would run."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    return server.capture(list(args), script=folder / script, cwd=elsewhere, env=hand_off_env(server.site, tmp_path),
                          replace_env=True, timeout=300)


def test_a_hand_off_run_has_the_import_path_of_a_fresh_python_s_process(tmp_path, bare_server):
    """What makes the forked hand-off runs stand for fresh ``python -S`` ones: the same import path, flags, folder
    and environment, and reprokit (or click, git, pytest) not importable; torch is merely imported already."""
    folder = tmp_path / "unpacked"
    folder.mkdir()
    (folder / "probe.py").write_text(textwrap.dedent("""
        import importlib.util, json, locale, os, sys
        print(json.dumps({"path": sys.path, "flags": list(sys.flags), "no_site": sys.flags.no_site, "cwd": os.getcwd(),
                          "env": dict(os.environ), "locale": locale.setlocale(locale.LC_CTYPE),
                          "encodings": [sys.getfilesystemencoding(), locale.getpreferredencoding(False)],
                          "executable": sys.executable, "argv": sys.argv,
                          "importable": {name: importlib.util.find_spec(name) is not None for name in
                                         ("torch", "numpy", "safetensors", "reprokit", "click", "git", "pytest")}}))
    """))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    fresh = subprocess.run([sys.executable, "-S", str(folder / "probe.py"), "x"],
                           env=hand_off_env(bare_server.site, tmp_path), cwd=elsewhere, capture_output=True,
                           text=True, timeout=60)
    forked = _hand_off(tmp_path, bare_server, folder, "probe.py", "x")
    assert fresh.returncode == forked.returncode == 0, fresh.stderr + forked.stderr
    want, got = json.loads(fresh.stdout), json.loads(forked.stdout)
    # PEP 538: an interpreter started in the C locale coerces it to C.UTF-8 and puts LC_CTYPE in its own
    # environment. The forked run has the locale its server coerced the same way (same "locale" and "encodings"
    # below); only the variable is not in its os.environ, which nothing but the processes it starts would read.
    assert want["env"].pop("LC_CTYPE", None) in (None, "C.UTF-8") and "LC_CTYPE" not in got["env"], want["env"]
    assert got == want
    assert got["path"][0] == str(folder) and got["no_site"] == 1 and got["cwd"] == str(elsewhere), got
    assert got["importable"] == {"torch": True, "numpy": True, "safetensors": True, "reprokit": False,
                                 "click": False, "git": False, "pytest": False}, got["importable"]


CASES = {
    # case: module, class, phase, exception type of the extract, op that made the value (or raised)
    "softmax": ("attn", "UnstableSoftmax", "forward", "FloatingPointError", "aten.exp.default"),
    "fp16": ("1", "Linear", "backward", "FloatingPointError", "aten.mm.default"),
    "embedding": ("tok", "Embedding", "forward", "IndexError", "aten.embedding.default"),
    # a functional softmax inside MaskedMix made the NaN; the hooks first see it at its child proj
    "masked": ("0", "MaskedMix", "forward", "FloatingPointError", "aten._softmax.default"),
    # a custom Function's backward forgets a transpose: aten.mm raises a shape error in backward
    "bad_backward": ("1", "HandLinear", "backward", "RuntimeError", "aten.mm.default"),
    # a custom Function's backward raises ValueError itself: no aten op to cut out, and extract says so
    "guarded": ("1", "Guarded", "backward", "ValueError", None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow
def test_extract_replays_from_the_packed_extract_alone(projects, tmp_path, bare_server, case):
    module, cls, phase, exc_type, op = CASES[case]
    bundle = _record(projects, tmp_path, case)
    out = tmp_path / "extract"
    r = cli("extract", bundle, "-o", out, "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["module"], d["class"], d["phase"], d["op"]) == (module, cls, phase, op), d
    assert d["failure"].startswith(exc_type), d
    assert d["bytes"] < 200_000, "an extract holds one module, not the model and optimizer"
    for command in ("verify", "inspect"):
        assert cli(command, out).exit_code == 0
    info = json.loads((out / "run.json").read_text())["extract"]
    assert info["module"] == module and info["phase"] == phase and info["source_bundle"] == str(bundle)
    rep = cli("replay", out, "--json")
    assert rep.exit_code == 1 and json.loads(rep.stdout)["verdict"] == "deterministic", rep.output

    packed = tmp_path / "extract.tar.gz"
    pack(out, packed)
    # The packed runtime is reprokit's replay modules as the pack's import walk finds them (~230 kB gzipped): plus one
    # module, never a model (a model's weights are megabytes).
    assert packed.stat().st_size < 280_000, f"{packed.stat().st_size} B: the runtime plus one module, not a model"
    top = _unpacked(tmp_path, packed)
    proc = _hand_off(tmp_path, bare_server, top, "repro.py", "--json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    got = json.loads(proc.stdout)
    assert got["verdict"] == "deterministic" and got["failure"]["exception_type"] == exc_type, got
    if op is not None:
        one = _hand_off(tmp_path, bare_server, top, "bundle/extract/op_repro.py")
        lines = one.stdout.strip().splitlines()
        assert one.returncode == 1 and lines[-1] == "REPRODUCED", one.stdout + one.stderr
        if exc_type == "FloatingPointError":
            assert f"{op}: " in one.stdout and "non-finite value(s) in its output" in one.stdout, one.stdout
        else:  # the same exception, type and message, as the whole bundle's
            assert f"{op}: raised {d['failure']}" in one.stdout, one.stdout
    else:
        assert not (top / "bundle" / "extract").exists()
    assert d["op_raised"] == (op is not None and exc_type != "FloatingPointError")
    if case == "guarded":
        assert any("no aten op raised ValueError: Python code raised it (rk_extract_zoo.py:backward)" in n
                   for n in d["notes"]), d["notes"]


def test_extract_into_a_folder_that_holds_files_is_refused(projects, tmp_path):
    bundle = _record(projects, tmp_path, "embedding")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "keep.txt").write_text("mine\n")
    r = cli("extract", bundle, "-o", tmp_path / "busy")
    assert r.exit_code == 2 and "not an empty folder" in r.output
    assert (tmp_path / "busy" / "keep.txt").read_text() == "mine\n"


@pytest.mark.slow
def test_no_module_to_blame_names_the_step_function_line(projects, tmp_path, bare_server):
    lm = projects("rk_lm_mask")
    cfg = {"vocab": 50}
    _, exc = record(lm, cfg, lm.batches(cfg, 5, empty=(3, 2)), tmp_path / "repros", snapshot_every=2)
    bundle = bundle_of(exc)
    layers = cli("bisect", "layers", bundle)
    assert layers.exit_code == 0
    assert "first non-finite: made by the step function, outside every module, at rk_lm_mask.py:32" in layers.output
    assert "inputs were already non-finite" not in layers.output
    out = tmp_path / "extract"
    r = cli("extract", bundle, "-o", out)
    assert r.exit_code == 1, r.output
    assert "no module to blame" in r.output and "rk_lm_mask.py:32" in r.output and "aten.div.Tensor" in r.output
    one = _hand_off(tmp_path, bare_server, out, "op_repro.py")
    assert one.returncode == 1 and "aten.div.Tensor: " in one.stdout, one.stdout + one.stderr


def test_a_nan_from_the_batch_is_no_module_fault(shared_nan_bundle, tmp_path):
    r = cli("extract", shared_nan_bundle, "-o", tmp_path / "x", "--json")
    assert r.exit_code == 1
    msg = json.loads(r.stdout)["error"]["message"]
    assert "no module to blame" in msg and "already held it" in msg, msg


@pytest.mark.slow
def test_an_exception_raised_outside_every_module_gets_the_op_alone(projects, tmp_path, bare_server):
    bundle = _record(projects, tmp_path, "loss_view")
    out = tmp_path / "x"
    r = cli("extract", bundle, "-o", out, "--json")
    assert r.exit_code == 1
    msg = json.loads(r.stdout)["error"]["message"]
    assert "no module to blame" in msg and "RuntimeError was raised outside every module" in msg, msg
    assert "aten.view.default raised it" in msg, msg
    one = _hand_off(tmp_path, bare_server, out, "op_repro.py")
    assert one.returncode == 1 and one.stdout.strip().splitlines()[-1] == "REPRODUCED", one.stdout + one.stderr
    assert "aten.view.default: raised RuntimeError: shape '[3, -1]' is invalid" in one.stdout, one.stdout


def test_an_op_that_does_not_fail_alone_is_not_written_as_a_repro():
    import torch

    from reprokit.extract import _checked

    notes: list[str] = []
    finite = {"op": "aten.add.Tensor", "args": [{"tensor": "t0"}, {"tensor": "t1"}], "kwargs": {},
              "tensors": {"t0": torch.ones(3), "t1": torch.ones(3)}}
    assert _checked(finite, notes) is None and "does not show the failure again" in notes[0]
    quiet = {**finite, "raises": {"type": "RuntimeError", "message": "boom"}}
    assert _checked(quiet, notes) is None and len(notes) == 2
    overflow = {**finite, "tensors": {"t0": torch.full((3,), 3e38), "t1": torch.full((3,), 3e38)}}
    assert _checked(overflow, notes) is overflow and len(notes) == 2


@pytest.mark.parametrize("case", ["masked", "bad_backward"])
@pytest.mark.slow
def test_a_module_over_the_size_limit_is_narrowed_to_its_one_op(projects, tmp_path, bare_server, case):
    from reprokit.bundle import open_bundle
    from reprokit.extract import extract

    module, cls, phase, exc_type, op = CASES[case]
    out = tmp_path / "extract"
    r = extract(open_bundle(_record(projects, tmp_path, case)), out, max_module_bytes=0)
    assert (r.level, r.module, r.cls, r.phase, r.op) == ("op", module, cls, phase, op)
    assert r.failure.startswith(exc_type) and any("the extract is the one op" in n for n in r.notes), r
    assert sorted(p.name for p in (out / "code").iterdir()) == ["rk_extract.py"], "no project code is needed"
    rep = cli("replay", out, "--json")
    assert rep.exit_code == 1 and json.loads(rep.stdout)["failure"]["exception_type"] == exc_type, rep.output
    packed = tmp_path / "extract.tar.gz"
    pack(out, packed)
    top = _unpacked(tmp_path, packed)
    proc = _hand_off(tmp_path, bare_server, top, "repro.py", "--json")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["failure"]["exception_type"] == exc_type


@pytest.mark.slow
def test_a_module_over_the_size_limit_without_one_op_is_carried_whole(projects, tmp_path):
    from reprokit.bundle import open_bundle
    from reprokit.extract import extract

    r = extract(open_bundle(_record(projects, tmp_path, "guarded")), tmp_path / "x", max_module_bytes=0)
    assert r.level == "module" and r.module == "1" and r.op is None
    assert any("no one op shows the failure alone: the extract carries them" in n for n in r.notes), r.notes


@pytest.mark.slow
def test_bisect_layers_names_the_module_whose_backward_raised(projects, tmp_path):
    r = cli("bisect", "layers", _record(projects, tmp_path, "guarded"))
    assert r.exit_code == 0, r.output
    assert "raised in module 1 (Guarded) in backward: ValueError: gradient too large" in r.output, r.output
    assert "the gradient it received: 0: float32[4, 16]" in r.output, r.output
