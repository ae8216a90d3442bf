"""SIGKILL at random points of a bundle dump: nothing half-written is ever taken for a bundle.

A child process (forked from the test process's fork server) trains the rk_mlp project until its loss goes NaN at
step 5; the recorder then dumps a bundle. An audit hook in the child counts every file operation under ``out_dir``
(opens for writing, folders made, renames) and SIGKILLs the process right before the K-th one: no ``finally``, no
``atexit``, nothing of reprokit runs after it. K is drawn at random among the operations of the dump (a first child,
never killed, lists them). After each kill: no bundle is committed; every leftover is a hidden ``.tmp-*`` folder
that ``find_leftovers`` calls abandoned, ``verify`` reports (exit 1) and ``inspect`` / ``replay`` refuse (exit 3),
unless the kill came right before the commit's rename (then the hidden folder is whole, yet never committed);
``reprokit gc`` removes them all. CI kills at 2 random points plus that one; the long run, at 50 or more:

    REPROKIT_KILL_POINTS=50 python -m pytest -q tests/integration/test_kill_during_dump.py
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import textwrap
from pathlib import Path

import pytest
from rk_testing import cli

from reprokit import bundle as B

PROJECTS = Path(__file__).resolve().parents[1] / "projects"
POINTS = int(os.environ.get("REPROKIT_KILL_POINTS", "2"))

CHILD = textwrap.dedent("""
    import json, os, signal, sys
    sys.path.insert(0, sys.argv[1])
    out, kill_at = os.path.realpath(sys.argv[2]), int(sys.argv[3])
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    seen = []

    def hook(event, args):
        if event == "open" and isinstance(args[2], int) and args[2] & WRITE and not isinstance(args[0], int):
            path = args[0]
        elif event in ("os.mkdir", "os.rename", "os.replace"):
            path = args[1] if event != "os.mkdir" else args[0]
        else:
            return
        path = os.path.realpath(os.fsdecode(path))
        if path == out or path.startswith(out + os.sep):
            seen.append(f"{event} {os.path.relpath(path, out)}")
            if len(seen) == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    import reprokit, rk_mlp
    sys.addaudithook(hook)
    state = rk_mlp.build({})
    rec = reprokit.Recorder(state, rk_mlp.train_step, build=rk_mlp.build, config={}, out_dir=out, snapshot_every=4)
    try:
        for b in rk_mlp.batches({}, 8, poison_step=5):
            rec.step(b)
    except reprokit.TrainingFailure:
        pass
    print(json.dumps(seen))
""")


def _child(forked, out: Path, kill_at: int) -> subprocess.CompletedProcess:
    """``CHILD`` run as a script in a process forked from the test process's fork server (a real process, which the
    audit hook SIGKILLs: the server reports -9 as ``subprocess`` would)."""
    script = out.parent / "child.py"
    if not script.exists():
        script.write_text(CHILD)
    return forked.capture([PROJECTS, out, kill_at], script=script, cwd=out.parent, timeout=300)


@pytest.mark.slow
def test_sigkill_at_random_points_of_a_dump_leaves_only_hidden_temp_folders_that_gc_removes(tmp_path, fork_server):
    whole = _child(fork_server, tmp_path / "calibrate", 0)  # 0: never killed (a kill point never reached kills nothing)
    assert whole.returncode == 0, whole.stderr
    ops = json.loads(whole.stdout.splitlines()[-1])
    assert ops[-1].startswith("os.rename bundle-"), ops  # the commit: os.replace audits as os.rename
    # The dump's operations (1-based): files and folders in the temp folder, then the rename that commits it.
    dump = [i for i, op in enumerate(ops, 1) if B.TMP_PREFIX in op] + [len(ops)]
    assert len(dump) >= 10, ops
    (bundle,) = [p for p in (tmp_path / "calibrate").iterdir()]
    assert B.verify(bundle) == [], "the unkilled run commits a valid bundle"

    rng = random.Random(int(os.environ.get("REPROKIT_KILL_SEED", "0")))
    # Fewer points than operations: a random sample. More: every operation, again and again (each a new process).
    points = rng.sample(dump, POINTS) if POINTS < len(dump) else [dump[i % len(dump)] for i in range(POINTS)]
    points = sorted(points + ([dump[-1]] if dump[-1] not in points else []))  # always right before the commit too
    for n, k in enumerate(points):
        out = tmp_path / f"kill{n}-at{k}"
        proc = _child(fork_server, out, k)
        assert proc.returncode == -signal.SIGKILL, (k, proc.returncode, proc.stderr[-2000:])
        assert "(killed after" not in proc.stderr, f"kill point {k}: the run hung until its time limit"
        entries = sorted(out.iterdir())  # empty when killed before the temp folder was made
        assert bool(entries) == (k > dump[0]), (k, ops[k - 1], entries)
        assert all(p.name.startswith(B.TMP_PREFIX) and p.is_dir() for p in entries), (k, ops[k - 1], entries)
        found = B.find_leftovers(out)
        assert [x.path for x in found] == entries and all(x.state == "abandoned" for x in found), (k, found)
        for tmp in entries:
            if k == len(ops):  # killed right before the commit's rename: whole, but hidden and never committed
                assert (tmp / B.MANIFEST).is_file() and cli("verify", tmp).exit_code == 0, k
                continue
            assert cli("verify", tmp).exit_code == 1, (k, ops[k - 1])
            assert cli("inspect", tmp).exit_code == 3, (k, ops[k - 1])
            assert cli("replay", tmp).exit_code == 3, (k, ops[k - 1])
        assert cli("gc", out).exit_code == 0 and list(out.iterdir()) == [], k
    print(f"{len(points)} kills over the {len(dump)} operations of the dump, at {points}")
