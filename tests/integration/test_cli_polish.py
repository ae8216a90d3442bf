"""CLI polish: progress only on a terminal, option env variables, pack's receiver line,
precision's n/a for SDPA variants, inspect of a shrunk bundle, bisect steps/layers tables."""

from __future__ import annotations

import json
import os
import pty
import shlex
import subprocess
import sys
import tarfile
import threading

import click
import pytest
from click.testing import CliRunner
from rk_testing import bundle_of, env_with_checkout, record

from reprokit.bisect.layers import format_layers
from reprokit.bisect.steps import format_steps
from reprokit.cli import main


def _commands(group: click.Group, words: tuple[str, ...] = ()):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*words, name))
        else:
            yield (*words, name), cmd


def test_every_option_reads_reprokit_command_option_from_the_environment():
    seen = 0
    for words, cmd in _commands(main):
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.is_eager:
                continue
            long = max((o for o in p.opts if o.startswith("--")), key=len)
            want = "_".join(["REPROKIT", *words, long[2:]]).upper().replace("-", "_")
            assert p.envvar == want, f"{' '.join(words)} {long}: {p.envvar!r}, the docs promise {want}"
            seen += 1
    assert seen > 60


def test_json_and_variants_from_the_environment(nan_bundle):
    r = CliRunner().invoke(main, ["replay", str(nan_bundle)], env={"REPROKIT_REPLAY_JSON": "1"})
    assert r.exit_code == 1, r.output
    assert json.loads(r.stdout)["verdict"] == "deterministic"
    r = CliRunner().invoke(main, ["bisect", "precision", str(nan_bundle)],
                           env={"REPROKIT_BISECT_PRECISION_JSON": "1", "REPROKIT_BISECT_PRECISION_VARIANTS": "recorded"})
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["variants"] == {"recorded": "fail"}


@pytest.mark.slow
def test_no_progress_when_stderr_is_not_a_terminal(nan_bundle, tmp_path):
    r = CliRunner().invoke(main, ["replay", str(nan_bundle), "--times", "2"])
    assert r.exit_code == 1, r.output
    assert "\r" not in r.stderr and "replay 1/2" not in r.output
    assert r.stdout.startswith("REPRODUCED: 2/2")
    r = CliRunner().invoke(main, ["shrink", str(nan_bundle), "-o", str(tmp_path / "s"), "--passes", "rows",
                                  "--budget", "10"])
    assert r.exit_code == 0, r.output
    assert r.stderr == "" and r.stdout.startswith("shrunk in ")
    r = CliRunner().invoke(main, ["replay", str(nan_bundle), "--times", "2", "--json"])
    assert "\r" not in r.stderr and json.loads(r.stdout)["runs"] == 2


@pytest.mark.slow
def test_progress_bar_on_a_terminal_stays_off_stdout(nan_bundle):
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "reprokit", "replay", str(nan_bundle), "--times", "3"],
                            stdout=subprocess.PIPE, stderr=slave, env=env_with_checkout(COLUMNS="100"), cwd="/",
                            text=True)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    t = threading.Thread(target=drain, daemon=True)
    t.start()
    out, _ = proc.communicate(timeout=300)
    t.join(10)
    os.close(master)
    err = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 1, (out, err)
    assert "replay" in err and "run 3/3" in err and "3/3" in err, err
    assert err.rstrip().endswith("\x1b[?25h"), "the bar ends its own line"
    assert out.startswith("REPRODUCED: 3/3") and "\r" not in out and "run 3/3" not in out


def test_pack_prints_the_folder_the_archive_extracts_to(nan_bundle, tmp_path):
    r = CliRunner().invoke(main, ["pack", str(nan_bundle), "-o", str(tmp_path / "x.tar.gz")])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.stdout.splitlines() if "receiver:" in x)
    assert "*" not in line
    folder = shlex.split(line.split("&&", 1)[1])[1].split("/")[0]
    with tarfile.open(tmp_path / "x.tar.gz") as tf:
        tops = {m.name.split("/")[0] for m in tf.getmembers()}
    assert tops == {folder} and folder.startswith("repro-")
    d = json.loads(CliRunner().invoke(main, ["pack", str(nan_bundle), "-o", str(tmp_path / "y.tar.gz"), "--json"]).stdout)
    assert d["folder"] == folder


@pytest.mark.slow
def test_sdpa_variants_are_na_on_a_model_without_attention(nan_bundle):
    r = CliRunner().invoke(main, ["bisect", "precision", str(nan_bundle), "--variants", "recorded,sdpa_math,sdpa_flash",
                                  "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["variants"] == {"recorded": "fail", "sdpa_math": "n/a", "sdpa_flash": "n/a"}
    assert "never called scaled_dot_product_attention" in d["details"]["sdpa_math"]
    # without the recorded variant, the SDPA variant's own replay tells
    r = CliRunner().invoke(main, ["bisect", "precision", str(nan_bundle), "--variants", "sdpa_math"])
    assert r.exit_code == 0, r.output
    assert r.stdout.count("sdpa_math") == 1 and "n/a" in r.stdout
    assert r.stderr == "", "each variant once, on stdout; no progress lines off a terminal"


@pytest.mark.slow
def test_sdpa_backend_without_a_kernel_is_na_and_math_still_runs(projects, tmp_path):
    attn = projects("rk_attn_cpu")
    _, exc = record(attn, {}, attn.batches(6, poison_step=4), tmp_path, snapshot_every=3)
    r = CliRunner().invoke(main, ["bisect", "precision", str(bundle_of(exc)), "--variants",
                                  "recorded,sdpa_math,sdpa_flash", "--json"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["variants"] == {"recorded": "fail", "sdpa_math": "fail", "sdpa_flash": "n/a"}, d["details"]
    assert "No available kernel" in d["details"]["sdpa_flash"]


@pytest.mark.slow
def test_inspect_of_a_shrunk_bundle_shows_where_it_came_from(nan_bundle, tmp_path):
    out = tmp_path / "small"
    r = CliRunner().invoke(main, ["shrink", str(nan_bundle), "-o", str(out), "--passes", "steps,rows", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    r = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    p = json.loads(r.stdout)["provenance"]
    assert p["source_bundle"] == str(nan_bundle) and p["kept_rows"] == s["kept_rows"] == [3]
    text = CliRunner().invoke(main, ["inspect", str(out)]).stdout
    assert f"shrunk   from {nan_bundle}" in text
    assert "kept rows [3] of the failing batch (dataset indices [99])" in text
    assert "  before steps 3, rows 16" in text
    assert "  passes " in text and "steps 1/2 accepted, 1 replay" in text and "1 replays" not in text
    assert "(1 step," in text and "1 steps" not in text


def test_bisect_steps_table_shows_five_grads_and_layers_never_cut_names():
    row = {"step": 7, "loss": 1.0, "grad_norm": 2.0, "lr": [0.1], "scale": None, "bad": None,
           "top_grads": [(f"p{i}", 1.0 / (i + 1)) for i in range(6)]}
    text = format_steps({"per_step": [row], "first_bad_step": None, "reason": None, "failure_step": 7})
    assert all(f"p{i} " in text for i in range(5)) and "p5" not in text
    frame = {"module": "transformer.h.11.mlp.act", "class": "NewGELUActivation", "phase": "forward",
             "inputs": None, "outputs": None}
    text = format_layers({"frames": [frame]})
    assert "NewGELUActivation" in text and "transformer.h.11.mlp.act" in text
