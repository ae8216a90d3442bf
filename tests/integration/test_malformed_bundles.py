"""Consistent but malformed bundles: wrong JSON (or safetensors headers) under re-signed checksums.

Each case is a real recorded bundle whose file was edited the way a buggy writer, another tool or a
hand edit would, with the manifest's checksums and self digest recomputed. ``verify`` must report
the file as a problem (exit 1), ``inspect`` and ``replay`` must refuse it as an invalid bundle
(exit 3) with a message naming file and field, and nothing may end in a traceback.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from rk_testing import cli, reseal

from reprokit import bundle as B
from reprokit.bundle import schema

ROOT = Path(__file__).resolve().parents[2]


def edit_json(bundle: Path, rel: str, edit: Callable[[dict], object] | None = None,
              text: Callable[[str], str] | None = None) -> None:
    doc = json.loads((bundle / rel).read_text())
    if edit:
        doc = edit(doc) or doc
    out = json.dumps(doc)
    (bundle / rel).write_text(text(out) if text else out)
    reseal(bundle)


def assert_refused(bundle: Path, file: str, words: str) -> None:
    problems = B.verify(bundle)
    assert any(p["file"] == file and words in p["problem"] for p in problems), problems
    v = cli("verify", str(bundle))
    assert v.exit_code == 1 and file in v.output and words in v.output, v.output
    for cmd in ("inspect", "replay"):
        r = cli(cmd, str(bundle))
        assert r.exit_code == 3, (cmd, r.exit_code, r.output)
        assert f"{file}: " in r.output and words in r.output, (cmd, r.output)


def _set(path: list, value):
    def edit(doc):
        d = doc
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    return edit


def test_the_recorded_bundle_is_valid(nan_bundle):
    reseal(nan_bundle)
    assert B.verify(nan_bundle) == []
    assert cli("inspect", str(nan_bundle)).exit_code == 0


@pytest.mark.parametrize("edit, words", [
    (_set(["window", "steps", 1], "5"), "window.steps[1] must be an integer, got str"),
    (lambda run: run.pop("refs"), "refs is missing"),
    (_set(["refs"], {"build": {"module": "rk_mlp", "qualname": "build"}}), "refs.step is missing"),
    (_set(["window"], [4, 5, 6]), "window must be an object, got list"),
    (lambda run: [run], "<root> must be an object, got list"),
    (_set(["window", "steps"], [4, 5, 6, 7, 8]), "manifest lists no steps/00000007.json"),
    (_set(["recorder", "detect", "spike_window"], True), "recorder.detect.spike_window must be an integer"),
    (_set(["history", 0, "loss"], [1.0]), "history[0].loss must be a number"),
], ids=["string-step", "no-refs", "no-step-ref", "window-list", "run-list", "step-without-file", "bool-int",
        "loss-list"])
def test_malformed_run_json_is_an_invalid_bundle(nan_bundle, edit, words):
    edit_json(nan_bundle, "run.json", edit)
    assert_refused(nan_bundle, "run.json", words)


def test_deep_nesting_is_refused_before_parsing(nan_bundle):
    deep = "[" * 100_000 + "]" * 100_000
    edit_json(nan_bundle, "run.json", _set(["config"], "@DEEP@"), text=lambda s: s.replace('"@DEEP@"', deep))
    assert_refused(nan_bundle, "run.json", "nests 100001 levels deep; at most 200")


@pytest.mark.parametrize("literal, words", [
    ("NaN", "NaN is not JSON"), ("-Infinity", "-Infinity is not JSON"), ("1e999", "out of range"),
])
def test_non_finite_numbers_are_not_strict_json(nan_bundle, literal, words):
    edit_json(nan_bundle, "run.json", _set(["window", "steps", 0], "@X@"), text=lambda s: s.replace('"@X@"', literal))
    assert_refused(nan_bundle, "run.json", words)


def test_over_long_string_is_refused(nan_bundle, monkeypatch):
    monkeypatch.setattr(schema, "MAX_STRING_CHARS", 50_000)  # stands for the 200 MB string
    edit_json(nan_bundle, "env.json", _set(["git"], None))  # a working tree's long diff would be refused first
    edit_json(nan_bundle, "env.json", _set(["python"], "x" * 50_001))
    assert_refused(nan_bundle, "env.json", "python is a string of 50001 characters")


def test_over_large_json_file_is_refused_before_reading(nan_bundle, monkeypatch):
    edit_json(nan_bundle, "run.json", _set(["config", "note"], "x" * 20_000))
    monkeypatch.setattr(schema, "MAX_JSON_BYTES", 10_000)  # stands for 64 MiB
    assert_refused(nan_bundle, "run.json", "bundle JSON files are at most 10000")


@pytest.mark.parametrize("rel, edit, words", [
    ("failure.json", _set(["step"], 1e300), "step must be an integer, got float"),
    ("failure.json", _set(["kind"], "oops"), "kind must be one of"),
    ("steps/00000005.json", _set(["step"], 4), "step is 4, but the file is named for step 5"),
    ("steps/00000005.json", _set(["batch", "x", "__rk_tensor__"], "batch/nope"), "which is not in the file's tensors"),
    ("state/state.json", _set(["rng", "numpy"], None), "rng.numpy must be a list, got null"),
    ("env.json", lambda env: env.__delitem__("torch"), "torch is missing"),
])
def test_other_malformed_files(nan_bundle, rel, edit, words):
    edit_json(nan_bundle, rel, edit)
    assert_refused(nan_bundle, rel, words)


@pytest.mark.parametrize("edit, words", [
    (_set(["version"], True), "unknown format version True"),
    (_set(["files", "run.json"], "meta"), "must be an object, got str"),
    (_set(["files", "run.json"], None), "must be an object, got null"),
    (_set(["files", "x" * 5000], {"sha256": "0" * 64, "size": 1}), "has a key of 5000 characters"),
    (_set(["files", "x" * 300], {"sha256": "0" * 64, "size": 1}), "not a usable file path"),
    (_set(["files", "run.json", "size"], -1), "size must be >= 0"),
    (_set(["files", "run.json", "sha256"], 5), "sha256 must be 64 lowercase hex digits"),
], ids=["version-true", "meta-string", "meta-null", "long-key", "long-name", "negative-size", "sha-int"])
def test_malformed_manifest_is_an_invalid_bundle(nan_bundle, edit, words):
    reseal(nan_bundle, edit)
    assert_refused(nan_bundle, "manifest.json", words)


def test_deeply_nested_manifest(nan_bundle):
    reseal(nan_bundle, raw_manifest="{\"created\": " + "[" * 100_000 + "]" * 100_000 + "}")
    assert_refused(nan_bundle, "manifest.json", "nests 100001 levels deep")


def _rewrite_header(path: Path, edit: Callable[[dict], None]) -> None:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def _shift_end(name: str, by: int):
    def edit(h):
        h[name]["data_offsets"][1] += by
    return edit


@pytest.mark.parametrize("edit, words", [
    (_shift_end("rng/torch", 10**6), "is not a range within the"),
    (lambda h: h["batch/x"].update(shape=[2**62, 2**62]), "needs"),
    (lambda h: h["batch/x"].update(dtype="F16"), "needs"),
    (lambda h: h["batch/x"].update(dtype="Q4"), "dtype must be one of"),
    (lambda h: h["batch/y"].update(data_offsets=h["batch/x"]["data_offsets"], shape=h["batch/x"]["shape"],
                                   dtype=h["batch/x"]["dtype"]), "overlapping"),
], ids=["beyond-file", "shape-overflow", "dtype-mismatch", "unknown-dtype", "overlap"])
def test_malformed_safetensors_header(nan_bundle, edit, words):
    _rewrite_header(nan_bundle / "steps/00000005.safetensors", edit)
    reseal(nan_bundle)
    assert_refused(nan_bundle, "steps/00000005.safetensors", words)


def test_header_length_beyond_the_file(nan_bundle):
    p = nan_bundle / "state/state.safetensors"
    raw = p.read_bytes()
    p.write_bytes(struct.pack("<Q", len(raw) * 4) + raw[8:])
    reseal(nan_bundle)
    assert_refused(nan_bundle, "state/state.safetensors", "declares a")


@pytest.mark.parametrize("rel", ["env.json", "failure.json", "run.json", "state/state.json", "steps/00000005.json"])
def test_a_json_file_holding_null_is_refused_not_skipped(nan_bundle, rel):
    """Found by tests/integration/test_fuzz.py: ``null`` was taken for "could not be read" and never checked."""
    edit_json(nan_bundle, rel, text=lambda s: "null")
    assert_refused(nan_bundle, rel, "<root> must be an object, got null")
