"""Strict JSON and safetensors header checks (reprokit.bundle.schema)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as st_save

from reprokit.bundle import schema
from reprokit.errors import BundleError

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "v1" / "demo-nan"


def test_depth_counts_brackets_outside_strings_only():
    assert schema.nesting_depth(b'{"a": [1, {"b": "[[[{{{"}], "c": "\\"]]]"}') == 3
    assert schema.nesting_depth(b"1") == 0
    assert schema.nesting_depth(b"[" * 100_000) == 100_000


def test_depth_limit_is_exact():
    ok = b"[" * schema.MAX_DEPTH + b"]" * schema.MAX_DEPTH
    assert schema.parse_json(ok, "x.json") == eval(ok.decode())  # noqa: S307 - nested empty lists
    with pytest.raises(schema.SchemaError, match=f"nests {schema.MAX_DEPTH + 1} levels"):
        schema.parse_json(b"[" + ok + b"]", "x.json")


@pytest.mark.parametrize("text, words", [
    (b'{"a": NaN}', "NaN is not JSON"),
    (b'[Infinity]', "Infinity is not JSON"),
    (b'[1e999]', "out of range"),
    (b'[-1e999]', "out of range"),
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b'\xff', "not valid strict JSON"),
    (b'[1, ', "not valid strict JSON"),
])
def test_not_strict_json(text, words):
    with pytest.raises(schema.SchemaError, match=words) as e:
        schema.parse_json(text, "run.json")
    assert isinstance(e.value, BundleError) and e.value.exit_code == 3
    assert e.value.problems[0]["file"] == "run.json"


def test_strings_and_keys_are_bounded(monkeypatch):
    monkeypatch.setattr(schema, "MAX_STRING_CHARS", 10)
    monkeypatch.setattr(schema, "MAX_KEY_CHARS", 5)
    assert schema.parse_json(b'{"abcde": ["0123456789"]}', "a.json") == {"abcde": ["0123456789"]}
    with pytest.raises(schema.SchemaError, match=r"abcde\[0\] is a string of 11"):
        schema.parse_json(b'{"abcde": ["0123456789x"]}', "a.json")
    with pytest.raises(schema.SchemaError, match="key of 6 characters"):
        schema.parse_json(b'{"abcdef": 1}', "a.json")


def test_file_size_is_checked_before_reading(tmp_path, monkeypatch):
    p = tmp_path / "run.json"
    p.write_text(json.dumps({"a": "x" * 100}))
    monkeypatch.setattr(schema, "MAX_JSON_BYTES", 50)
    with pytest.raises(schema.SchemaError, match="at most 50"):
        schema.load_json(p, "run.json")


def test_golden_files_pass_their_schemas():
    load = lambda rel: schema.load_json(GOLDEN / rel, rel)  # noqa: E731
    schema.check_manifest(load("manifest.json"))
    schema.check_run(load("run.json"))
    schema.check_failure(load("failure.json"))
    schema.check_env(load("env.json"))
    schema.check_state(load("state/state.json"), schema.check_safetensors(GOLDEN / "state/state.safetensors", "s"))
    keys = schema.check_safetensors(GOLDEN / "steps/00000006.safetensors", "t")
    schema.check_step(load("steps/00000006.json"), 6, keys, "steps/00000006.json")


def test_detection_lag_in_run_json_reads_as_0_when_absent_and_is_checked_when_present():
    run = schema.load_json(GOLDEN / "run.json", "run.json")
    assert "detected_lag" not in run and schema.detected_lag(run) == 0  # written before checks lagged
    schema.check_run({**run, "detected_lag": 3, "recorder": {**run["recorder"], "max_lag": 8}})
    assert schema.detected_lag({**run, "detected_lag": 3}) == 3
    for bad, field in (({**run, "detected_lag": -1}, "detected_lag"), ({**run, "detected_lag": 1.5}, "detected_lag"),
                       ({**run, "recorder": {**run["recorder"], "max_lag": "8"}}, "recorder.max_lag")):
        with pytest.raises(schema.SchemaError, match=field):
            schema.check_run(bad)


def _file(tmp_path: Path, header: dict, data: bytes) -> Path:
    h = json.dumps(header).encode()
    p = tmp_path / "t.safetensors"
    p.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return p


def test_safetensors_written_by_the_library_pass(tmp_path):
    p = tmp_path / "ok.safetensors"
    p.write_bytes(st_save({"a": torch.ones(2, 3), "b": torch.zeros(0, dtype=torch.int64),
                           "c": torch.tensor(True), "d": torch.ones(4, dtype=torch.bfloat16)}))
    assert schema.check_safetensors(p, "ok") == {"a", "b", "c", "d"}


@pytest.mark.parametrize("header, data, words", [
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, "not a range within the 4-byte"),
    ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8, "needs 12 bytes"),
    ({"a": {"dtype": "F32", "shape": [2**62, 2**62, 4], "data_offsets": [0, 8]}}, b"\0" * 8, "needs"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8, r"shape\[0\] must be >= 0"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12, "overlapping"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8, "a gap"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8, "4 bytes of data no tensor covers"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 8, "not a range"),
    ({"a": {"dtype": "X9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "dtype must be one of"),
    ({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4, "data_offsets is missing"),
    ({"a": [1]}, b"", "must be an object, got list"),
    ({"__metadata__": {"k": 1}}, b"", "must be a string"),
])
def test_malformed_safetensors_headers(tmp_path, header, data, words):
    with pytest.raises(schema.SchemaError, match=words):
        schema.check_safetensors(_file(tmp_path, header, data), "t.safetensors")


def test_header_length_beyond_the_file(tmp_path):
    p = tmp_path / "t.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    with pytest.raises(schema.SchemaError, match="declares a"):
        schema.check_safetensors(p, "t")
    p.write_bytes(b"\1\2")
    with pytest.raises(schema.SchemaError, match="too short"):
        schema.check_safetensors(p, "t")
    p.write_bytes(struct.pack("<Q", 3) + b"{[}")
    with pytest.raises(schema.SchemaError, match="not valid strict JSON"):
        schema.check_safetensors(p, "t")
