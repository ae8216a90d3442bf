"""Helpers shared by the test tiers: recording (``record``, ``record_mlp_nan``), running the CLI in process
(``cli``) or as a user's shell does (``cli_process``), two CPU ranks under torchrun (``torchrun``), and editing bundles
as a sender could (``reseal``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata as md
from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

import reprokit
from reprokit import bundle as B

ROOT = Path(__file__).resolve().parents[1]
PROJECTS = ROOT / "tests" / "projects"

# The run of the NaN bundle most tests share (``shared_nan_bundle`` in conftest.py; ``nan_bundle`` is a copy): rk_mlp,
# 8 steps, a NaN in one input (row 3) at step 6, a snapshot every 4 steps. The bundle holds the snapshot of step 4 and
# steps 4, 5 and 6; the NaN's dataset index is 6 * 16 + 3.
NAN_STEPS, NAN_STEP, NAN_SNAPSHOT_EVERY = 8, 6, 4


def record(mod: Any, config: dict, batches: Iterable, out_dir: Path, step: Any = None,
           **kw: Any) -> tuple[reprokit.Recorder, BaseException | None]:
    """Train ``mod`` on ``batches`` under a Recorder until something raises."""
    state = mod.build(config)
    rec = reprokit.Recorder(state, step or mod.train_step, build=mod.build, config=config, out_dir=out_dir, **kw)
    for b in batches:
        try:
            rec.step(b)
        except Exception as e:  # noqa: BLE001 - the test inspects whatever came out
            return rec, e
    return rec, None


def bundle_of(exc: BaseException | None) -> Path:
    """The bundle path a failure carries (TrainingFailure.bundle or the exception's note)."""
    assert exc is not None, "training did not fail"
    if isinstance(exc, reprokit.TrainingFailure):
        assert exc.bundle is not None
        return Path(exc.bundle)
    notes = [n for n in getattr(exc, "__notes__", []) if n.startswith("reprokit: bundle written to ")]
    assert notes, f"no bundle note on {exc!r}"
    return Path(notes[-1].removeprefix("reprokit: bundle written to "))


def record_mlp_nan(out_dir: Path, steps: int = NAN_STEPS, poison_step: int = NAN_STEP,
                   snapshot_every: int = NAN_SNAPSHOT_EVERY) -> Path:
    """Record the rk_mlp test project until the poisoned step's NaN loss; the bundle path. With no arguments, the
    shared NaN bundle's run (tests that only need a valid bundle of a NaN take the ``shared_nan_bundle`` or
    ``nan_bundle`` fixture instead of recording one)."""
    import importlib

    sys.path.insert(0, str(PROJECTS))
    try:
        mlp = importlib.import_module("rk_mlp")
    finally:
        sys.path.remove(str(PROJECTS))
    _, exc = record(mlp, {}, mlp.batches({}, steps, poison_step=poison_step), out_dir, snapshot_every=snapshot_every)
    return bundle_of(exc)


def copy_bundle(bundle: Path, dest_dir: Path) -> Path:
    """A fresh copy of ``bundle`` (same folder name) inside ``dest_dir``: what a test that changes a shared bundle
    works on."""
    return Path(shutil.copytree(bundle, Path(dest_dir) / Path(bundle).name, symlinks=True))


def tree_digest(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (relative path, links and folders included) with its sha256: equal digests mean
    nothing in the folder changed."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        rel = p.relative_to(folder).as_posix()
        out[rel] = ("link:" + os.readlink(p) if p.is_symlink() else "dir" if p.is_dir() else B.sha256_file(p))
    return out


def cli(*args: Any) -> Result:
    """Run ``reprokit ARGS`` in this process with click's CliRunner (each argument ``str()``-ed) and return the
    result (``.exit_code``, ``.output``, ``.stdout``). Fails the test when the command ended in anything but one of
    its documented exits: a Python exception escaping it, or a traceback or "internal error" in what it printed."""
    from reprokit.cli import main

    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exception is None or isinstance(r.exception, SystemExit), (args, repr(r.exception), r.output[-3000:])
    assert "Traceback" not in r.output and "internal error" not in r.output, (args, r.output[-3000:])
    return r


def env_with_checkout(*paths: Path | str, **extra: str) -> dict[str, str]:
    """This process's environment with this checkout (then ``paths``) alone on ``PYTHONPATH``, so a child process
    imports the reprokit under test; ``extra`` variables set on top."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [ROOT, *paths])), **extra}


def cli_process(*args: Any, cwd: Path | str = "/", env: dict[str, str] | None = None,
                timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m reprokit ARGS`` in a fresh process (text output captured) from ``cwd``, with
    :func:`env_with_checkout` unless ``env`` is given (the test projects are not importable there: a replay must
    use the bundle's own code): what a user's shell runs, start-up and exit included."""
    return subprocess.run([sys.executable, "-m", "reprokit", *map(str, args)], cwd=cwd,
                          env=env_with_checkout() if env is None else env, capture_output=True, text=True,
                          timeout=timeout)


def torchrun(script: Path, *args: Any, cwd: Path, launcher: Sequence[str] = (),
             timeout: float = 240, fresh_ranks: bool | None = None) -> subprocess.CompletedProcess:
    """Run ``script ARGS`` on two CPU ranks under ``python -m torch.distributed.run`` (gloo; the scripts pick it) on a
    free local port, one thread per rank, the test projects importable and faulthandler on (a hung rank dumps its
    stack). ``launcher`` adds torchrun options (``["--max-restarts", "1"]``). Text output captured. The launcher is
    forked from this process's fork server (``rk_forked.shared``: no torch import of its own), and so is each rank,
    from the rank server (``rk_ranks``: torchrun starts a stand-in per rank that hands it over), unless
    ``fresh_ranks``: then torchrun starts each rank as a fresh process. ``fresh_ranks`` defaults to
    ``not rk_ranks.forks_ranks()`` (fresh on a machine with a CUDA device, forked on a CPU-only one).
    Past ``timeout`` the launcher is killed (exit -9)."""
    from rk_forked import shared
    from rk_ranks import forks_ranks, torchrun_argv

    from reprokit.distributed.incident import free_port

    env = env_with_checkout(PROJECTS, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    rank = [str(script), *map(str, args)]
    if fresh_ranks is None:
        fresh_ranks = not forks_ranks()
    if not fresh_ranks:
        rank, env = torchrun_argv(script, list(args), env)
    argv = ["--nproc_per_node", "2", *launcher, "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
            *rank]
    return shared().capture(argv, module="torch.distributed.run", cwd=cwd, env=env, replace_env=True,
                            timeout=timeout)


_DDP_NAN_RUN: list[tuple[Path, subprocess.CompletedProcess, float]] = []


def ddp_nan_run(tmp_path_factory: Any) -> tuple[Path, subprocess.CompletedProcess, float]:
    """``tests/projects/rk_ddp.py OUT nan cpu`` on two CPU ranks (:func:`torchrun`): rank 1 feeds a NaN at step 6,
    windows from the snapshot of step 4, one incident folder in ``OUT``. Run once per test process (the session's
    ``tmp_path_factory`` keeps its folder) and shared by every test module that takes it (test_distributed.py,
    test_replicated.py): ``(OUT, the torchrun's CompletedProcess, its seconds)``. Shared, so read-only: a test that
    changes the incident copies it first."""
    import time

    if not _DDP_NAN_RUN:
        out = tmp_path_factory.mktemp("ddp_nan") / "repros"
        t0 = time.monotonic()
        proc = torchrun(PROJECTS / "rk_ddp.py", out, "nan", "cpu", cwd=out.parent)
        _DDP_NAN_RUN.append((out, proc, time.monotonic() - t0))
    return _DDP_NAN_RUN[0]


def minimal_site(dest: Path) -> Path:
    """A folder of links to torch (with what it requires), numpy and safetensors, and nothing else: put it alone on
    ``PYTHONPATH`` of a ``python -S`` process to run a packed repro as a colleague with only those installed would
    (shared by the pack and extract tests and bench/extract_size.py)."""
    dest.mkdir()
    todo, done, markers = ["torch", "numpy", "safetensors"], set(), set()
    while todo:
        name = todo.pop()
        if name.lower() in done:
            continue
        done.add(name.lower())
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            if name in markers:  # a requirement for other Pythons or platforms (`; python_version < "3.8"`)
                continue
            raise
        reqs = [(re.split(r"[ ;<>=!~\[(]", req, maxsplit=1)[0], ";" in req) for req in dist.requires or []
                if "extra ==" not in req]
        todo += [n for n, _ in reqs]
        markers |= {n for n, marked in reqs if marked}
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            src = Path(dist.locate_file(top))
            if src.exists() and not (dest / top).exists() and top != "__pycache__":
                (dest / top).symlink_to(src)
    return dest


def reseal(bundle: Path, manifest_edit: Callable[[dict], object] | None = None, raw_manifest: str | None = None) -> None:
    """Re-sign a bundle after its files were edited, as a careless tool (or a sender) would: every listed file's
    checksum and size again, then ``manifest_edit(manifest)``, then the manifest's own digest. ``raw_manifest``
    writes that text instead (``@SELF@`` replaced by the digest)."""
    m = json.loads((bundle / B.MANIFEST).read_text())
    for rel in m["files"]:
        p = bundle / rel
        m["files"][rel] = {"sha256": B.sha256_file(p), "size": p.stat().st_size}
    if manifest_edit:
        manifest_edit(m)
    m["self_sha256"] = B._self_digest(m)
    (bundle / B.MANIFEST).write_text(raw_manifest.replace("@SELF@", m["self_sha256"]) if raw_manifest else json.dumps(m))


def entries(bundle: Path) -> list[str]:
    """``["--entry", "build=...,step=..."]``: the user's confirmation of a bundle's refs that ``--code`` needs
    (a test made the bundle, so it vouches for them)."""
    from reprokit.code import entry_args

    return entry_args(json.loads((Path(bundle) / "run.json").read_text())["refs"])


def record_incident_of_one(out_dir: Path) -> Path:
    """An incident folder, cheaply: rank 0 of a one-process gloo group (no torchrun) fails at step 1 with an
    IndexError; its bundle is written into an incident folder, as every rank's is under torchrun."""
    import datetime
    import importlib
    import sys

    import torch
    import torch.distributed as dist

    from reprokit.distributed.incident import free_port

    projects = str(Path(__file__).parent / "projects")
    sys.path.insert(0, projects)
    try:
        project = importlib.import_module("rk_dist_incidents")
    finally:
        sys.path.remove(projects)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        state = project.build({})
        rec = reprokit.Recorder(state, project.train_step, build=project.build, config={}, out_dir=out_dir,
                                snapshot_every=2, incident_wait_s=1)
        try:
            x = torch.randn(8, 8)
            rec.step({"x": x, "y": x.sum(1), "boom": torch.tensor(False)})
            try:
                rec.step({"x": x, "y": x.sum(1), "boom": torch.tensor(True)})
            except IndexError:
                pass
        finally:
            rec.close()
    finally:
        dist.destroy_process_group()
    (bundle,) = rec.bundles
    return bundle.parent


def with_failure(bundle: Path, out_dir: Path, failure: Any, name: str | None = None) -> Path:
    """A copy of ``bundle`` whose failure.json is ``failure`` (a :class:`reprokit.signature.Failure`), written through
    the bundle writer (checksums, manifest last): the window, state, env and code are the source's, unchanged."""
    src = B.open_bundle(bundle)
    steps = []
    for k in src.steps:
        doc, tensors = src.step_doc(k)
        steps.append(B.StepRecord(k, doc["batch"], tensors, doc["rng"], doc.get("loss"), doc.get("grad_norm")))
    code = [] if src.code_dir is None else [
        (p.relative_to(src.code_dir).as_posix(), p) for p in sorted(src.code_dir.rglob("*")) if p.is_file()]
    return B.write_bundle(B.BundleWriter(Path(out_dir), name or f"{Path(bundle).name}-{failure.kind}"),
                          failure=failure.to_json(), run=src.run, env=src.env, state=src.state(), steps=steps,
                          code=code)
