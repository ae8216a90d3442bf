"""What code replay runs, and from where: a bundle never chooses it, nothing in a bundle is loaded unverified.

Real recorded bundles (the rk_mlp project), real temp checkouts, hostile edits re-signed as a sender would.
"""

from __future__ import annotations

import importlib
import json
import shutil
import stat
from pathlib import Path

import pytest
from rk_testing import cli, entries, reseal

import reprokit
from reprokit import bundle as B
from reprokit.code import parse_entries
from reprokit.errors import ConfigError
from reprokit.shrink import shrink

replay_mod = importlib.import_module("reprokit.replayer")  # the module that replays (reprokit.replay is its function)


def marker_code(marker: Path) -> str:
    """A module that, imported, leaves a file behind (and has the functions replay looks for)."""
    return (f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
            "def build(config):\n    raise SystemExit('swapped code ran')\n"
            "def train_step(state, batch):\n    raise SystemExit('swapped code ran')\n")


# --- 1. the code snapshot is imported from the bytes that were verified ---------------------------------

def test_code_swapped_after_verification_never_runs(nan_bundle, tmp_path):
    """The bundle verifies; then, before replay imports, code/rk_mlp.py is swapped in the folder. Replay refuses the
    changed file instead of importing it (it used to import the folder's file, unchecked since verify)."""
    marker = tmp_path / "MARKER"
    opened = B.open_bundle(nan_bundle)  # verification ends here
    (nan_bundle / "code" / "rk_mlp.py").write_text(marker_code(marker))
    with pytest.raises(reprokit.BundleError, match=r"code/rk_mlp.py changed since the manifest was checked"):
        reprokit.replay(opened)
    assert not marker.exists(), "the swapped code ran"


def test_a_swap_after_the_private_copy_is_made_is_not_seen(nan_bundle, tmp_path, monkeypatch):
    """The latest a swap can land: right after the verified bytes were written to the private copy. Replay imports
    that copy (mode 0700), reproduces the recorded failure with the recorded code, and removes the copy after."""
    marker = tmp_path / "MARKER"
    made: list[Path] = []
    modes: list[tuple[int, int]] = []
    real = replay_mod.materialize

    def then_swap(files):
        root, remove = real(files)
        made.append(root)
        modes.append((stat.S_IMODE(root.parent.stat().st_mode), stat.S_IMODE((root / "rk_mlp.py").stat().st_mode)))
        (nan_bundle / "code" / "rk_mlp.py").write_text(marker_code(marker))
        return root, remove

    monkeypatch.setattr(replay_mod, "materialize", then_swap)
    report = reprokit.replay(nan_bundle)
    assert report.verdict == "deterministic" and report.exit_code == 1
    assert not marker.exists(), "the swapped code ran"
    assert report.code == str(nan_bundle / "code"), "the report names the bundle's code, not the temp copy"
    (root,) = made
    assert modes == [(0o700, 0o600)], "the copy is private to this user"
    assert not root.parent.exists(), "the private copy is removed when the replay returns"


def test_cli_replay_of_a_swapped_code_file_exits_3(nan_bundle, tmp_path, monkeypatch):
    """Through the CLI: swapped between the CLI's verification and the session (hooked at reprokit's open)."""
    marker = tmp_path / "MARKER"
    real = B.open_bundle

    def open_then_swap(path):
        b = real(path)
        (nan_bundle / "code" / "rk_mlp.py").write_text(marker_code(marker))
        return b

    monkeypatch.setattr(B, "open_bundle", open_then_swap)
    r = cli("replay", str(nan_bundle))
    assert r.exit_code == 3 and "code/rk_mlp.py changed since the manifest was checked" in r.output, r.output
    assert not marker.exists()


# --- 2. --code runs only the entry points the user names ----------------------------------------------

def hostile(bundle: Path, checkout: Path, marker: Path) -> None:
    """A sender's bundle naming a function of the user's checkout that is no training entry point, listed in its
    own snapshot too (so the snapshot check passes), and a checkout that has such a function."""
    (checkout / "scripts").mkdir()
    (checkout / "scripts" / "__init__.py").write_text("")
    (checkout / "scripts" / "deploy.py").write_text(
        f"import pathlib\ndef main(config):\n    pathlib.Path({str(marker)!r}).write_text('deployed')\n")
    (bundle / "code" / "scripts").mkdir()
    for rel in ("scripts/__init__.py", "scripts/deploy.py"):
        (bundle / "code" / rel).write_text((checkout / rel).read_text())
    run = json.loads((bundle / B.RUN).read_text())
    run["refs"]["build"] = {"module": "scripts.deploy", "qualname": "main"}
    (bundle / B.RUN).write_text(json.dumps(run))

    def add(m):
        for rel in ("code/scripts/__init__.py", "code/scripts/deploy.py"):
            m["files"][rel] = {"sha256": B.sha256_file(bundle / rel), "size": (bundle / rel).stat().st_size}

    reseal(bundle, add)
    assert B.verify(bundle) == []


def checkout_of(bundle: Path, dest: Path) -> Path:
    return Path(shutil.copytree(bundle / "code", dest))


def test_a_bundle_cannot_pick_a_function_of_the_users_checkout(nan_bundle, tmp_path):
    marker = tmp_path / "DEPLOYED"
    code = checkout_of(nan_bundle, tmp_path / "checkout")
    hostile(nan_bundle, code, marker)
    r = cli("replay", str(nan_bundle), "--code", str(code))
    assert not marker.exists(), "the bundle ran scripts.deploy:main of the user's checkout"
    assert r.exit_code == 2, r.output
    assert "build = scripts.deploy:main" in r.output and "--entry build=scripts.deploy:main,step=rk_mlp:train_step" in r.output
    # Confirming the usual entry points does not confirm the bundle's other choice.
    r = cli("replay", str(nan_bundle), "--code", str(code), "--entry", "build=rk_mlp:build,step=rk_mlp:train_step")
    assert r.exit_code == 2 and "not confirmed with --entry: build = scripts.deploy:main" in r.output, r.output
    for cmd in (["shrink", str(nan_bundle), "-o", str(tmp_path / "small")], ["bisect", "steps", str(nan_bundle)]):
        r = cli(*cmd, "--code", str(code))
        assert r.exit_code == 2 and "not confirmed with --entry" in r.output, r.output
    # bisect commits replays each commit's checkout as --code: the same confirmation, asked before any git work.
    r = cli("bisect", "commits", str(nan_bundle), "--good", "HEAD~1", "--bad", "HEAD")
    assert r.exit_code == 2 and "each commit's checkout" in r.output, r.output
    assert "not confirmed with --entry: build = scripts.deploy:main" in r.output, r.output
    assert not marker.exists()


def test_confirmed_entry_points_replay_from_the_checkout(nan_bundle, tmp_path):
    code = checkout_of(nan_bundle, tmp_path / "checkout")
    r = cli("replay", str(nan_bundle), "--code", str(code), "--entry", "build=rk_mlp:build",
                  "--entry", "rk_mlp:train_step")
    assert r.exit_code == 1 and r.output.startswith("REPRODUCED"), r.output
    assert f"code from {code}" in r.output
    r = cli("replay", str(nan_bundle), "--code", str(code), "--entry", "step=rk_mlp:train_step")
    assert r.exit_code == 2 and "not confirmed with --entry: build = rk_mlp:build" in r.output, r.output
    r = cli("replay", str(nan_bundle), "--entry", "build=rk_mlp:build")
    assert r.exit_code == 2 and "--entry only applies with --code" in r.output, r.output


def test_entry_syntax_errors_say_the_form():
    assert parse_entries(["build=a.b:build, step=a:step", "c:f"]) == {("build", "a.b:build"), ("step", "a:step"),
                                                                      (None, "c:f")}
    for bad in ("build=rk_mlp", "deploy=rk_mlp:main", "a:b:c"):
        with pytest.raises(ConfigError, match=r"expected \[ROLE=\]MODULE:QUALNAME"):
            parse_entries([bad])


# --- 3. shrink --code: the result carries the code it was verified against ----------------------------

SANITIZED = "def train_step(state, batch):\n    batch = {**batch, 'x': torch.nan_to_num(batch['x'])}\n"


@pytest.mark.slow
def test_shrink_with_code_writes_the_code_it_shrank_against(nan_bundle, tmp_path):
    """The bundle's snapshot is a fixed version (the NaN row sanitised: it passes); --code DIR is the buggy code,
    which fails. The shrunk result must replay with DIR's code, as shrink confirmed, not the passing snapshot."""
    code = checkout_of(nan_bundle, tmp_path / "buggy")
    snap = nan_bundle / "code" / "rk_mlp.py"
    snap.write_text(snap.read_text().replace("def train_step(state, batch):\n", SANITIZED))
    reseal(nan_bundle)
    assert reprokit.replay(nan_bundle).verdict == "not_reproduced", "the snapshot itself passes"
    out = tmp_path / "small"
    r = cli("shrink", str(nan_bundle), "-o", str(out), "--code", str(code), *entries(nan_bundle),
                   "--passes", "steps", "--budget", "20")
    assert r.exit_code == 0, r.output
    assert f"code: shrunk against --code {code.resolve()}" in r.output, r.output
    assert (out / "code" / "rk_mlp.py").read_bytes() == (code / "rk_mlp.py").read_bytes()
    report = reprokit.replay(out)
    assert report.verdict == "deterministic" and report.exit_code == 1, report.to_json()
    provenance = json.loads((out / B.RUN).read_text())["provenance"]
    assert provenance["code"]["shrunk_against"] == str(code.resolve())


@pytest.mark.slow
def test_shrink_without_code_keeps_the_verified_snapshot(nan_bundle, tmp_path):
    out = tmp_path / "small"
    shrink(nan_bundle, out, passes=["steps"], budget=20)
    want = {p.relative_to(nan_bundle / "code").as_posix(): p.read_bytes() for p in (nan_bundle / "code").rglob("*.py")}
    got = {p.relative_to(out / "code").as_posix(): p.read_bytes() for p in (out / "code").rglob("*.py")}
    assert got == want
    assert reprokit.replay(out).exit_code == 1


# --- 4. one run does not claim determinism ----------------------------------------------------------------

@pytest.mark.slow
def test_one_run_is_not_called_deterministic(nan_bundle):
    r = cli("replay", str(nan_bundle))
    assert r.exit_code == 1
    head = r.output.splitlines()[0]
    assert head.startswith("REPRODUCED: 1/1 runs") and "reproduced once; --times N tells deterministic" in head, head
    assert "(deterministic)" not in r.output
    d = json.loads(cli("replay", str(nan_bundle), "--json").stdout)
    assert d["verdict"] == "deterministic" and d["determinism_checked"] is False
    r = cli("replay", str(nan_bundle), "--times", "2")
    assert r.exit_code == 1 and "(deterministic)" in r.output.splitlines()[0], r.output
    d = json.loads(cli("replay", str(nan_bundle), "--times", "2", "--json").stdout)
    assert d["verdict"] == "deterministic" and d["determinism_checked"] is True


@pytest.mark.slow
def test_assert_fixed_does_not_call_one_run_deterministic(nan_bundle, tmp_path):
    from reprokit.testing import StillFails, assert_fixed

    with pytest.raises(StillFails) as e:
        assert_fixed(nan_bundle)
    assert "1/1 runs, reproduced once; times=N (--reprokit-times N)" in str(e.value), str(e.value)
    assert "deterministic)" not in str(e.value)
    code = checkout_of(nan_bundle, tmp_path / "checkout")
    with pytest.raises(StillFails) as e:
        assert_fixed(nan_bundle, code=code)
    # The command it suggests runs as suggested: --code needs the --entry.
    assert f"--code {code} --entry build=rk_mlp:build,step=rk_mlp:train_step`" in str(e.value)
