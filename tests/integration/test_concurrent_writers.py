"""Two writers, one name: recorders sharing an out_dir that fail at the same step in the same second, and two
``shrink -o SAME`` at once. Neither may lose a bundle, write it under a name nobody asked for, or fail after its run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from rk_testing import copy_bundle

from reprokit import bundle as B
from reprokit.cli import main
from reprokit.errors import ReprokitError


def test_concurrent_commits_under_one_name_keep_every_bundle(tmp_path):
    """Writers released together at the commit: each sees the name free, only one rename can take it."""
    out = tmp_path / "repros"
    for round_ in range(25):
        barrier = threading.Barrier(3)
        results: dict[int, Path | BaseException] = {}

        def write(i: int, round_: int = round_, barrier: threading.Barrier = barrier,
                  results: dict = results) -> None:
            try:
                with B.BundleWriter(out, f"bundle-{round_}") as w:
                    w.write_json("run.json", {"writer": i})
                    barrier.wait()
                    results[i] = w.commit()
            except BaseException as e:  # noqa: BLE001 - reported below
                results[i] = e

        threads = [threading.Thread(target=write, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(isinstance(r, Path) for r in results.values()), results
        paths = {r for r in results.values() if isinstance(r, Path)}
        assert len(paths) == 3, paths
        writers = sorted(int((p / "run.json").read_text().split(":")[1].strip(" }\n")) for p in paths)
        assert writers == [0, 1, 2]
    assert not [p for p in out.iterdir() if p.name.startswith(B.TMP_PREFIX)]


@pytest.mark.slow
def test_a_second_shrink_to_the_same_output_is_refused_up_front(shared_nan_bundle, tmp_path, tmp_path_factory,
                                                               fork_server):
    """The first ``python -m reprokit shrink`` runs in a process of its own (forked from the fork server), the second
    in this one while the first holds the claim."""
    bundle = copy_bundle(shared_nan_bundle, tmp_path)
    same = tmp_path / "small"
    claim = tmp_path / f".small{B.CLAIM_SUFFIX}"
    log = tmp_path_factory.mktemp("first-shrink") / "log"  # outside tmp_path, whose listing is checked
    pid = fork_server.start(None, ["shrink", bundle, "-o", same], module="reprokit", cwd=Path("/"), log=log)
    try:
        deadline = time.monotonic() + 120
        while not claim.exists() and _running(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert claim.exists(), "the first shrink never claimed its output"
        t0 = time.monotonic()
        second = CliRunner().invoke(main, ["shrink", str(bundle), "-o", str(same)])
        assert second.exit_code == 2 and "is being written by process" in second.output, second.output
        assert time.monotonic() - t0 < 30
    finally:
        code = fork_server.wait()
    assert code == 0, log.read_text()
    assert B.verify(same) == []
    assert not claim.exists() and sorted(p.name for p in tmp_path.iterdir()) == [bundle.name, "small"]


def _running(pid: int) -> bool:
    """Whether process ``pid`` still runs (not gone, not a zombie its parent has yet to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_claim_left_by_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    claim = tmp_path / f".small{B.CLAIM_SUFFIX}"
    claim.write_text(f"pid{dead.stdout.strip()}.0-on-{B._host()}")
    with B.claimed_output(tmp_path / "small"):
        assert claim.read_text() != f"pid{dead.stdout.strip()}.0-on-{B._host()}"
    assert not claim.exists()


def test_an_empty_claim_is_taken_over_once_stale_and_refused_while_fresh(tmp_path):
    """A writer killed between creating its claim and writing its name leaves an empty claim: it blocks the output only
    while it may still be a live writer's (a few seconds), never for good."""
    claim = tmp_path / f".small{B.CLAIM_SUFFIX}"
    claim.write_text("")
    with pytest.raises(ReprokitError, match="another process"):
        with B.claimed_output(tmp_path / "small"):
            pass
    old = time.time() - 2 * B.STALE_CLAIM_S
    os.utime(claim, (old, old))
    with B.claimed_output(tmp_path / "small"):
        assert claim.read_text().startswith("pid")
    assert not claim.exists()
