"""Messages for a newcomer's likely mistakes name the thing to pass next."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner
from rk_testing import record_mlp_nan

import reprokit
from reprokit.cli import main
from reprokit.errors import BundleError


def test_replaying_the_out_dir_suggests_its_newest_bundle(tmp_path):
    out_dir = tmp_path / "repros"
    first = record_mlp_nan(out_dir, steps=6, poison_step=4, snapshot_every=2)
    later = out_dir / first.name.replace(first.name.split("-")[1], "29991231")  # a later run's bundle
    shutil.copytree(first, later)
    r = CliRunner().invoke(main, ["replay", str(out_dir)])
    assert r.exit_code == 3, r.output
    assert "looks like the recorder's out_dir" in r.output and f"e.g. {later}" in r.output, r.output


def test_python_replay_of_the_out_dir_names_a_bundle_in_it(tmp_path):
    out_dir = tmp_path / "repros"
    bundle = record_mlp_nan(out_dir, steps=6, poison_step=4, snapshot_every=2)
    with pytest.raises(BundleError) as e:
        reprokit.replay(out_dir)
    assert bundle.name in str(e.value) and "intact copy" not in str(e.value), str(e.value)
