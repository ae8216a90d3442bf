"""Temp folders of killed bundle writers: found, judged by their writer, removed by `reprokit gc`."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import textwrap

import pytest
from click.testing import CliRunner

from reprokit import bundle as B
from reprokit.cli import main

WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from reprokit import bundle as B
    w = B.BundleWriter(Path(sys.argv[1]), "bundle-20260101-000000-step00000007-nonfinite_loss")
    w.write_tensors("state/state.safetensors", {"a": torch.zeros(4096)})
    print(w.tmp, flush=True)
    time.sleep(600)
""")


def _gc(*args: str) -> tuple[int, dict]:
    r = CliRunner().invoke(main, ["gc", *args, "--json"])
    return r.exit_code, json.loads(r.output)


@pytest.mark.slow
def test_sigkilled_writer_leaves_a_folder_that_gc_removes_and_a_live_one_it_keeps(tmp_path, tmp_path_factory,
                                                                                  fork_server):
    """The writer is a process of its own, forked from the fork server (no torch import of its own)."""
    import time

    out = tmp_path / "repros"
    work = tmp_path_factory.mktemp("writer")  # its script and output, outside tmp_path
    (work / "writer.py").write_text(WRITER)
    (work / "log").write_text("")  # there from the start (the run appends to it)
    pid = fork_server.start(work / "writer.py", [str(out)], cwd=work, log=work / "log")
    try:
        deadline = time.monotonic() + 120
        while not (tmp := (work / "log").read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tmp and os.path.isdir(tmp), f"the writer started: {tmp}"
        code, d = _gc(str(out))
        assert code == 0 and [(x["state"], x["removed"]) for x in d["leftovers"]] == [("writing", False)]
        assert d["leftovers"][0]["owner"].startswith(f"pid {pid} ") and d["leftovers"][0]["bytes"] > 16384
        os.kill(pid, signal.SIGKILL)  # no cleanup can run
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        assert fork_server.wait() == -signal.SIGKILL
    assert os.path.isdir(tmp), "SIGKILL leaves the temp folder behind"
    (found,) = B.find_leftovers(out)
    assert found.state == "abandoned" and str(found.path) == tmp
    code, d = _gc(str(out), "--dry-run")
    assert code == 0 and d["dry_run"] and not d["leftovers"][0]["removed"] and os.path.isdir(tmp)
    human = CliRunner().invoke(main, ["gc", str(out)])
    assert human.exit_code == 0 and "removed .tmp-bundle-" in human.output and "1 abandoned" in human.output
    assert not os.path.exists(tmp) and list(out.iterdir()) == []
    assert _gc(str(out))[1]["leftovers"] == []
    assert CliRunner().invoke(main, ["gc", str(tmp_path / "nope")]).exit_code == 2


def test_the_recorder_mentions_leftovers_when_it_starts_and_ctrl_c_in_a_dump_leaves_none(projects, tmp_path):
    import subprocess
    import sys

    import pytest

    import reprokit

    mlp = projects("rk_mlp")
    # A writer killed outright: a temp folder whose pid is gone.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    from reprokit import bundle as B

    w = B.BundleWriter(tmp_path, "bundle-x")
    w.write_bytes("big.bin", b"\0" * 4096)
    assert f"pid{os.getpid()}." in w.tmp.name
    orphan = w.tmp.with_name(w.tmp.name.replace(f"pid{os.getpid()}.", f"pid{pid}."))
    w.tmp.rename(orphan)
    assert [x.path for x in B.find_leftovers(tmp_path) if x.removable] == [orphan]
    state = mlp.build({})
    with pytest.warns(reprokit.RecorderWarning, match="reprokit gc"):
        rec = reprokit.Recorder(state, mlp.train_step, build=mlp.build, config={}, out_dir=tmp_path)

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    rec._write = interrupted
    batches = list(mlp.batches({}, 8, poison_step=6))
    with pytest.raises(KeyboardInterrupt):
        for b in batches:
            rec.step(b)
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")] == [orphan], "Ctrl-C left nothing new"
