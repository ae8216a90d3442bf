"""The exit-code tables of the docs (docs/reference/exit-codes.md) are true for every command; with --json every outcome
is one JSON object."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import git
import pytest
from click.testing import CliRunner
from rk_testing import copy_bundle, entries

from reprokit.cli import main

EXIT_CODES_PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "exit-codes.md"
COMMANDS = ["replay", "inspect", "verify", "shrink", "bisect steps", "bisect layers", "bisect precision",
            "bisect commits", "pack", "extract", "gc", "demo"]


def documented_codes() -> dict[str, set[int]]:
    """Command -> the exit codes the docs' "Every command" table allows it."""
    text = EXIT_CODES_PAGE.read_text()
    table = text[text.index("## Every command"):]
    rows = re.findall(r"^\| (\d+) \| .*? \| ([^|]+) \|$", table.split("\n## ")[0], flags=re.M)
    assert len(rows) >= 7, rows
    allowed: dict[str, set[int]] = {c: set() for c in COMMANDS}
    for code, who in rows:
        who = who.split("(")[0].strip()
        named = {c for c in COMMANDS if re.search(rf"\b{c}\b", who)}
        for c in (set(COMMANDS) - named if who.startswith("all") else named):
            allowed[c].add(int(code))
    return allowed


def test_cli_table_agrees_with_the_exit_code_table():
    allowed = documented_codes()
    text = EXIT_CODES_PAGE.read_text()
    rows = re.findall(r"^\| `reprokit ([a-z ]+?) [A-Z\[].*\| ([^|]*) \|$", text, flags=re.M)
    assert {c for c, _ in rows} == set(COMMANDS) and len(rows) == len(COMMANDS), rows
    for command, codes in rows:
        listed = {int(n) for n in re.findall(r"\b\d+\b", codes)}
        assert listed and listed <= allowed[command], (command, listed, allowed[command])


@pytest.fixture(scope="module")
def targets(shared_nan_bundle, tmp_path_factory):
    """A valid bundle, a missing path, a non-bundle file and an empty folder; and a git repo for bisect commits."""
    root = tmp_path_factory.mktemp("targets")
    valid = copy_bundle(shared_nan_bundle, root / "repros")
    (root / "notes.txt").write_text("not a bundle\n")
    (root / "empty").mkdir()
    repo = git.Repo.init(root / "repo")
    actor = git.Actor("Dev", "dev@example.com")
    for k in range(2):
        (root / "repo" / "CHANGES").write_text(f"change {k}\n")
        repo.index.add(["CHANGES"])
        repo.index.commit(f"commit {k}", author=actor, committer=actor)
    return {"valid": valid, "missing": root / "missing", "file": root / "notes.txt",
            "empty": root / "empty", "repo": root / "repo", "root": root}


# Per command and target: the exit code it must give. A valid bundle's bisect commits has no
# good end in this throwaway repository (the project folder is not there): a wrong end, 2.
EXPECTED = {
    "valid": {"replay": 1, "inspect": 0, "verify": 0, "shrink": 0, "bisect steps": 0, "bisect layers": 0,
              "bisect precision": 0, "bisect commits": 2, "pack": 0, "extract": 1, "gc": 0},
    "missing": dict.fromkeys(COMMANDS[:-1], 2),
    "file": {**dict.fromkeys(COMMANDS[:-1], 3), "gc": 2},
    "empty": {**dict.fromkeys(COMMANDS[:-1], 3), "verify": 1, "gc": 0},
}
# Exits that are answers, not errors: no {"error": ...} object.
ANSWERS = {("replay", 1), ("verify", 1), ("gc", 0), ("bisect steps", 1), ("bisect layers", 1), ("bisect precision", 1)}


def argv(command: str, target: Path, t: dict, n: str) -> list[str]:
    extra = {"shrink": ["-o", str(t["root"] / f"shrunk-{n}"), "--budget", "20"],
             "pack": ["-o", str(t["root"] / f"packed-{n}.tar.gz")],
             "extract": ["-o", str(t["root"] / f"extract-{n}")],
             "bisect commits": ["--good", "HEAD~1", "--bad", "HEAD", "--repo", str(t["repo"])]}.get(command, [])
    return [*command.split(), str(target), *extra]


# "valid" runs every command to its end on a real bundle (shrink, the bisect axes, extract): the slow one.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "valid" else c for c in EXPECTED])
def test_every_command_exits_as_documented(targets, case):
    allowed = documented_codes()
    runner = CliRunner()
    for n, (command, want) in enumerate(EXPECTED[case].items()):
        args = argv(command, targets[case], targets, f"{case}-{n}")
        result = runner.invoke(main, [*args, "--json"])
        where = f"{case}: reprokit {' '.join(args)} --json -> {result.exit_code}\n{result.output}"
        assert result.exit_code == want, where
        assert result.exit_code in allowed[command], where
        d = json.loads(result.stdout)  # exactly one JSON object, nothing else on stdout
        assert isinstance(d, dict), where
        if want != 0 and (command, want) not in ANSWERS:
            assert d.keys() == {"error"} and d["error"]["exit_code"] == want, where
            assert d["error"]["type"] and d["error"]["message"], where
        else:
            assert "error" not in d, where
        if case != "valid":  # the same code without --json, and text instead of JSON
            human = runner.invoke(main, args)
            assert human.exit_code == want and "{" not in human.stdout, where
            assert ("Error: " in human.stderr) == ((command, want) not in ANSWERS), where


def test_demo_out_on_a_file_is_a_usage_error(targets):
    result = CliRunner().invoke(main, ["demo", "--out", str(targets["file"]), "--json"])
    assert result.exit_code == 2 and result.exit_code in documented_codes()["demo"]
    assert json.loads(result.stdout)["error"]["type"] == "BadParameter"


def test_usage_errors_give_a_json_object_too(targets):
    r = CliRunner().invoke(main, ["replay", str(targets["valid"]), "--times", "0", "--json"])
    assert r.exit_code == 2 and json.loads(r.stdout)["error"]["exit_code"] == 2
    r = CliRunner().invoke(main, ["replay", str(targets["valid"]), "--no-such-option", "--json"])
    assert r.exit_code == 2 and json.loads(r.stdout)["error"]["type"] == "NoSuchOption"
    # --json set through the environment, as every option can be.
    r = CliRunner().invoke(main, ["inspect", str(targets["missing"])], env={"REPROKIT_INSPECT_JSON": "1"})
    assert r.exit_code == 2 and "does not exist" in json.loads(r.stdout)["error"]["message"]


def checkout(bundle: Path, dest: Path, append: str) -> Path:
    shutil.copytree(bundle / "code", dest)
    with open(dest / "rk_mlp.py", "a") as f:
        f.write(append)
    return dest


UNMOVABLE = '''

_build = build


def build(config):
    state = _build(config)

    def to(*args, **kwargs):
        raise RuntimeError("this model refuses to move")

    state.model.to = to
    return state
'''


def test_internal_error_is_70_with_one_line_and_a_saved_traceback(targets, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    code = checkout(targets["valid"], tmp_path / "code", UNMOVABLE)
    result = CliRunner().invoke(main, ["replay", str(targets["valid"]), "--code", str(code), *entries(targets["valid"])])
    assert result.exit_code == 70, result.output
    assert result.stdout == ""
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("Error: internal error: RuntimeError: this model refuses")
    saved = Path(re.search(r"the traceback is in (\S+);", err).group(1))
    assert saved.parent == tmp_path and "RuntimeError: this model refuses to move" in saved.read_text()
    assert "Traceback (most recent call last)" in saved.read_text()

    result = CliRunner().invoke(main, ["replay", str(targets["valid"]), "--code", str(code),
                                       *entries(targets["valid"]), "--json"])
    assert result.exit_code == 70
    e = json.loads(result.stdout)["error"]
    assert e["type"] == "RuntimeError" and e["exit_code"] == 70 and e["internal"] is True
    assert Path(e["traceback"]).is_file() and "this model refuses to move" in e["message"]


def test_interrupt_is_130_not_an_answer(targets, tmp_path):
    code = checkout(targets["valid"], tmp_path / "code", "\n\ndef build(config):\n    raise KeyboardInterrupt\n")
    result = CliRunner().invoke(main, ["replay", str(targets["valid"]), "--code", str(code),
                                       *entries(targets["valid"]), "--json"])
    assert result.exit_code == 130 and json.loads(result.stdout)["error"]["type"] == "Interrupted"


def test_user_prints_do_not_break_the_json(targets, tmp_path):
    code = checkout(targets["valid"], tmp_path / "code",
                    "\n\n_step = train_step\n\n\ndef train_step(state, batch):\n    print('loss is', 1.0)\n"
                    "    return _step(state, batch)\n")
    result = CliRunner().invoke(main, ["replay", str(targets["valid"]), "--code", str(code),
                                       *entries(targets["valid"]), "--json"])
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["verdict"] == "deterministic"
    assert "loss is 1.0" in result.stderr
