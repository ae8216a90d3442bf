"""``replay INCIDENT_DIR`` says, as one bundle's replay does, that it runs the bundles' code when they came from
elsewhere, and honours ``--trust``; ``--sha256`` is refused as for one bundle folder."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from rk_testing import record_incident_of_one, reseal

from reprokit.cli import main

NOTE = "reprokit: replaying runs code"


@pytest.fixture(scope="module")
def foreign_incident(tmp_path_factory):
    """An incident folder whose bundle says it was recorded on another host."""
    folder = record_incident_of_one(tmp_path_factory.mktemp("repros"))
    (bundle,) = [p for p in folder.iterdir() if p.is_dir()]
    env = json.loads((bundle / "env.json").read_text())
    env["host"] = "a-colleagues-machine"
    (bundle / "env.json").write_text(json.dumps(env))
    reseal(bundle)
    return folder


@pytest.mark.slow
def test_replaying_a_foreign_incident_prints_the_code_note_and_trust_silences_it(foreign_incident):
    r = CliRunner().invoke(main, ["replay", str(foreign_incident), "--json"])
    assert r.exit_code == 1, r.output  # reproduced
    assert json.loads(r.stdout)["verdict"] in ("deterministic", "reproduced")
    (note,) = [line for line in r.stderr.splitlines() if line.startswith(NOTE)]
    assert "recorded on a-colleagues-machine" in note and "--trust" in note
    trusted = CliRunner().invoke(main, ["replay", str(foreign_incident), "--trust", "--json"])
    assert trusted.exit_code == 1, trusted.output
    assert NOTE not in trusted.stderr


def test_sha256_on_an_incident_folder_is_refused_as_for_a_bundle_folder(foreign_incident):
    r = CliRunner().invoke(main, ["replay", str(foreign_incident), "--sha256", "0" * 64, "--json"])
    assert r.exit_code == 2
    e = json.loads(r.stdout)["error"]
    assert e["type"] == "ConfigError" and e["message"].startswith("--sha256 checks an archive")
