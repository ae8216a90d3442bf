"""``reprokit inspect INCIDENT_DIR`` summarises an incident folder of a multi-rank run (it refused the folder, while
``replay`` took it): the ranks, the rank that failed first, each rank's failure and bundle; human and ``--json``."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from rk_testing import record_incident_of_one

from reprokit.cli import main


@pytest.fixture(scope="module")
def incident(tmp_path_factory):
    return record_incident_of_one(tmp_path_factory.mktemp("repros"))


def test_inspect_json_lists_every_rank_and_who_failed_first(incident):
    r = CliRunner().invoke(main, ["inspect", str(incident), "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    (bundle,) = [p for p in incident.iterdir() if p.is_dir()]
    assert (d["folder"], d["world_size"], d["failing_rank"], d["declared_by"], d["step"]) == (
        str(incident), 1, 0, 0, 1)
    assert d["incident"]["incident"] == incident.name
    (rank,) = d["ranks"]
    assert (rank["rank"], rank["bundle"], rank["failure"]) == (0, str(bundle), {"kind": "exception", "step": 1})
    assert "IndexError" in rank["what"] and rank["window"] == {"start": 0, "end": 1}


def test_inspect_human_says_who_failed_first_and_where_each_bundle_is(incident):
    r = CliRunner().invoke(main, ["inspect", str(incident)])
    assert r.exit_code == 0, r.output
    (bundle,) = [p for p in incident.iterdir() if p.is_dir()]
    assert r.output.startswith(f"incident {incident.name}: 1 rank, rank 0 failed first (step 1; declared by rank 0)")
    assert "rank 0: " in r.output and "IndexError" in r.output and f"bundle {bundle} (steps 0-1)" in r.output
    assert f"reprokit replay {incident}" in r.output


def test_inspect_of_an_incident_refuses_the_one_bundle_options(incident):
    r = CliRunner().invoke(main, ["inspect", str(incident), "--batch"])
    assert r.exit_code == 2 and "incident folder" in r.output
