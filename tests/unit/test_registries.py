"""Each extension point lists its names once (shrink passes, bisect axes, precision variants, failure kinds), and
everything else (the command line's help and defaults, the implementations) reads that list."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from reprokit.bisect import registry as bisect_registry
from reprokit.registry import bind
from reprokit.shrink import registry as shrink_registry
from reprokit.signature import KINDS, Failure, FailureKind

ROOT = Path(__file__).resolve().parents[2]


def test_the_registries_import_no_torch():
    code = ("import sys; import reprokit.shrink.registry, reprokit.bisect.registry, reprokit.cli; "
            "loaded = [m for m in ('torch', 'numpy') if m in sys.modules]; assert not loaded, loaded")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr


def test_implementations_follow_the_registries():
    from reprokit.bisect import axis
    from reprokit.bisect.precision import VARIANTS
    from reprokit.shrink import PASSES

    assert list(PASSES) == list(shrink_registry.PASS_NAMES)
    assert shrink_registry.DATA_PASSES < set(PASSES)
    assert list(VARIANTS) == list(bisect_registry.VARIANTS)
    for name in bisect_registry.REPLAY_AXES:
        run, text = axis(name)
        assert run.__name__ == f"bisect_{name}" and text.__name__ == f"format_{name}"
    assert set(bisect_registry.REPLAY_AXES) < set(bisect_registry.AXES)
    with pytest.raises(ValueError, match="no replay axis 'commits'"):
        axis("commits")


def test_the_command_line_reads_the_registries():
    from reprokit.cli import main

    shrink_help = " ".join(CliRunner().invoke(main, ["shrink", "--help"]).output.split())
    assert f"[default: {','.join(shrink_registry.PASS_NAMES)}]" in shrink_help, shrink_help
    precision_help = " ".join(CliRunner().invoke(main, ["bisect", "precision", "--help"]).output.split())
    assert ", ".join(bisect_registry.VARIANTS) in precision_help, precision_help
    r = CliRunner().invoke(main, ["bisect", str(ROOT)])  # a path where the axis goes: every axis is named
    assert r.exit_code == 2 and "reprokit bisect steps|layers|precision|commits" in r.output, r.output
    assert all(f"{name}: {finds}" in " ".join(r.output.split()) for name, finds in bisect_registry.AXES.items())


def test_bind_refuses_a_name_registered_or_implemented_alone():
    assert list(bind(("b", "a"), {"a": 1, "b": 2}, "letters")) == ["b", "a"]
    with pytest.raises(RuntimeError, match=r"\['c'\] not implemented, \[\] not in the registry"):
        bind(("a", "c"), {"a": 1}, "letters")
    with pytest.raises(RuntimeError, match=r"\[\] not implemented, \['z'\] not in the registry"):
        bind(("a",), {"a": 1, "z": 2}, "letters")


def test_failure_kinds_are_strings_where_json_and_old_bundles_meet_them():
    assert KINDS == tuple(k.value for k in FailureKind) and len(set(KINDS)) == len(KINDS)
    kind = FailureKind.NONFINITE_LOSS
    assert kind == "nonfinite_loss" and "nonfinite_loss" in {kind} and {"nonfinite_loss": 1}[kind] == 1
    assert f"{kind}" == str(kind) == "nonfinite_loss" and json.dumps({"kind": kind}) == '{"kind": "nonfinite_loss"}'
    made = Failure(kind, 3, message="loss = nan")
    assert type(made.kind) is str and made.to_json()["kind"] == "nonfinite_loss"
    assert Failure.from_json(json.loads(json.dumps(made.to_json()))) == made
    for k in FailureKind:  # every kind says what it is in words
        text = Failure(k, 1, exc_type="ValueError", message="m").describe()
        assert text and "None" not in text, (k, text)
