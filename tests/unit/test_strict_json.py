"""Strict JSON against crafted input: the depth pre-scan stays exact and fast, and text that is not Unicode is
refused with a message, never a traceback far from the parse."""

from __future__ import annotations

import json
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reprokit import bundle as B
from reprokit.bundle import schema


def _reference_depth(data: bytes) -> int:
    """Deepest nesting as a JSON reader sees it, one character at a time (the obvious, slow way)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in data.decode():
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


_TEXT = st.text(alphabet='[]{}"\\ab\n\u00e9', max_size=8)
_DOCS = st.recursive(st.none() | st.integers() | _TEXT,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
                     max_leaves=30)


@settings(max_examples=300, deadline=None)
@given(_DOCS, st.booleans())
def test_depth_is_the_nesting_a_reader_sees(doc, ascii_only):
    """Brackets, quotes and backslashes inside strings never count; escapes are read as JSON reads them."""
    data = json.dumps(doc, ensure_ascii=ascii_only).encode()
    assert schema.nesting_depth(data) == _reference_depth(data)


def test_depth_carries_across_the_scan_pieces(monkeypatch):
    monkeypatch.setattr(schema, "_DEPTH_CHUNK", 5)  # a string, an escape and the brackets cut at every place
    data = json.dumps({"a\"[": [[1, {"b": ["]]\\\"[[", [[]]]}]], "c": "{{"}).encode()
    assert schema.nesting_depth(data) == _reference_depth(data) == 7


@pytest.mark.parametrize("body", [b'"' + b"a" * (48 << 20) + b'"', b"[" + b'"",' * (16 << 20) + b'""]'],
                         ids=["one long string", "millions of strings"])
def test_depth_of_megabytes_of_strings_is_quick(body):
    """The scan matched a regex per character of every string and stepped through a Python generator per match:
    48 MiB of JSON took 4-6 s here (up to half a minute on a busy machine) before the file could be refused, and
    a bundle may hold eight such files. It is a few C passes now (well under a second).

    Counted, not timed (a wall-clock bound misfires on a loaded machine): the Python lines and calls the scan runs
    stay far below one per string (16 Mi strings here; the old scan ran several per string). The trace stops the
    scan once over the bound, so the old code fails fast too."""
    bound = 2_000_000
    events = 0

    class TooMuchPython(Exception):
        pass

    def tracer(frame, event, arg):
        nonlocal events
        events += 1
        if events > bound:
            raise TooMuchPython
        return tracer

    sys.settrace(tracer)
    try:
        depth = schema.nesting_depth(body)
    except TooMuchPython:
        depth = None
    finally:
        sys.settrace(None)
    assert events <= bound, f"over {bound:,} Python trace events for {len(body) >> 20} MiB"
    assert depth == body.startswith(b"[")


@pytest.mark.parametrize("text", ['{"m": "name \\udcff"}', '{"\\ud800": 1}', '["ok", ["\\udfff"]]'])
def test_an_unpaired_surrogate_is_refused_as_not_unicode(text):
    with pytest.raises(schema.SchemaError, match="unpaired surrogate"):
        schema.parse_json(text.encode(), "failure.json")


def test_a_surrogate_pair_is_text():
    assert schema.parse_json(b'{"m": "\\ud83d\\ude00"}', "x.json") == {"m": "\U0001f600"}


def test_the_writer_never_writes_what_the_reader_refuses():
    """An exception message may hold a file name decoded with surrogateescape; it is written as its escape."""
    doc = {"message": "cannot open /data/\udcff.bin", "k\ud800": ["\udfff"]}
    back = schema.parse_json(B.dumps(doc), "failure.json")
    assert back == {"message": "cannot open /data/\\udcff.bin", "k\\ud800": ["\\udfff"]}


def test_sizes_read_as_people_read_them():
    """A tiny model's state read "model 0.0 kB" in ``inspect``."""
    from reprokit.report import _mb

    assert [_mb(n) for n in (48, 999, 4_500, 99_999, 1_234_567)] == ["48 B", "999 B", "4.5 kB", "100.0 kB", "1.23 MB"]
