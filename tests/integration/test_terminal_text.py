"""A bundle's strings (an exception message, say) reach the terminal with their control characters escaped."""

from __future__ import annotations

import subprocess
import sys
import tarfile

import pytest
from click.testing import CliRunner
from rk_testing import bundle_of, record

from reprokit.cli import main

RAW = ("\x1b", "\x07", "\r", "\u202e")


@pytest.fixture
def hostile(projects, tmp_path):
    esc = projects("rk_escape")
    _, exc = record(esc, {}, esc.batches(4, 2), tmp_path / "r", snapshot_every=2)
    assert isinstance(exc, ValueError) and exc.args[0] == esc.MESSAGE
    return bundle_of(exc)


@pytest.mark.parametrize("command", [["inspect"], ["replay"], ["shrink", "-o", "{tmp}/s"]])
def test_cli_text_escapes_control_characters(hostile, tmp_path, command):
    args = [a.format(tmp=tmp_path) for a in command]
    r = CliRunner().invoke(main, [args[0], str(hostile), *args[1:]])
    assert r.exit_code in (0, 1), r.output
    assert not any(c in r.output for c in RAW), repr(r.output)
    assert "\\x1b[2J" in r.output, r.output


@pytest.mark.slow
def test_a_packed_repro_prints_its_report_escaped(hostile, tmp_path):
    out = tmp_path / "r.tar"
    assert CliRunner().invoke(main, ["pack", str(hostile), "-o", str(out)]).exit_code == 0
    with tarfile.open(out) as tf:
        tf.extractall(tmp_path / "x", filter="data")
    (top,) = (tmp_path / "x").iterdir()
    proc = subprocess.run([sys.executable, "repro.py"], cwd=top, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "\\x1b[2J" in proc.stdout and not any(c in proc.stdout for c in RAW), repr(proc.stdout)


FORGED = "ok, every file matches the manifest"


@pytest.mark.parametrize("where", ["", "steps/", "code/"])
def test_a_file_name_cannot_print_a_line_of_its_own_in_verify(hostile, where, monkeypatch):
    """A stray file named ``x\\n<BUNDLE>: ok, ...`` (or holding a tab, a line separator) is listed on one line, its
    control characters escaped; the JSON object names it exactly (json escapes it) and is the only thing printed."""
    import json

    monkeypatch.chdir(hostile.parent)  # `reprokit verify BUNDLE` with no slash in BUNDLE: a name can spell it
    names = [f"x\n{hostile.name}: {FORGED}", "tab\there", "sep\u2028arator"]
    for name in names:
        (hostile / where / name).write_text("")
    r = CliRunner().invoke(main, ["verify", hostile.name])
    assert r.exit_code == 1, r.output
    assert FORGED not in r.output.split("\n", 1)[0]
    assert not any(line.startswith(f"{hostile.name}: ok") for line in r.output.splitlines()), r.output
    assert "\t" not in r.output and "\u2028" not in r.output, repr(r.output)
    assert r.output.count("\n") == 1 + len(names), r.output
    assert "x\\n" in r.output and "tab\\there" in r.output, r.output
    j = CliRunner().invoke(main, ["verify", "--json", hostile.name])
    files = {p["file"] for p in json.loads(j.output)["problems"]}
    assert {where + n for n in names} <= files, files
    assert "\n" + hostile.name not in j.output
