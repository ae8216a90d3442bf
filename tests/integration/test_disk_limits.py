"""What the filesystem can do to a command: a disk that fills up while writing, a leftover folder nested thousands
deep. Each ends in a documented exit code with a message that says what happened, never "This is a bug" (exit 70).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from reprokit import bundle as B
from reprokit.cli import main


@pytest.mark.slow
def test_gc_removes_an_abandoned_leftover_nested_3000_folders_deep(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    leftover = tmp_path / f".tmp-bundle-x-pid{dead.stdout.strip()}.0-on-{B._host()}-0123abcd"
    leftover.mkdir()
    fd = os.open(leftover, os.O_RDONLY)
    try:  # deeper than any path the OS takes whole (PATH_MAX): made one level at a time, relative to the last
        for _ in range(3000):
            os.mkdir("d", dir_fd=fd)
            (open("f", "w", opener=lambda p, fl, fd=fd: os.open(p, fl, 0o644, dir_fd=fd))).close()
            inner = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = inner
    finally:
        os.close(fd)
    try:
        r = CliRunner().invoke(main, ["gc", str(tmp_path)])
        assert r.exit_code == 0, r.output
        assert "internal error" not in r.output and not leftover.exists(), r.output
    finally:
        if leftover.exists():  # pytest's own clean-up of old temp folders recurses too (Python < 3.12)
            B.remove_tree(leftover)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs: a real full disk (needs the right to mount, as root in a container or CI has)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                                                       capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (not root)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_pack_onto_a_full_disk_says_so(shared_nan_bundle, small_disk):
    (small_disk / "filler").write_bytes(b"\0" * ((1 << 20) - 32 * 1024))  # what is left: less than the archive
    r = CliRunner().invoke(main, ["pack", str(shared_nan_bundle), "-o", str(small_disk / "r.tar")])
    assert r.exit_code == 2 and "no space left" in r.output.lower(), r.output
    assert "This is a bug" not in r.output
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"], "nothing partial is left"


def test_shrink_onto_a_full_disk_says_so(shared_nan_bundle, small_disk):
    (small_disk / "filler").write_bytes(b"\0" * ((1 << 20) - 32 * 1024))
    r = CliRunner().invoke(main, ["shrink", str(shared_nan_bundle), "-o", str(small_disk / "small"), "--budget", "3"])
    assert r.exit_code == 2 and "no space left" in r.output.lower(), r.output
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"], "nothing partial is left"
