"""The parallel gzip writer of ``reprokit pack -o X.tar.gz``: any gzip reader reads its members as one stream, its
bytes depend on the input alone, and deflate runs only where it saves something."""

from __future__ import annotations

import array
import gzip
import io
import random
import struct
import threading
import zlib

import pytest

from reprokit import gzip_members
from reprokit.gzip_members import GzipMembers, level_for, member


def _floats(n: int, seed: int = 0) -> bytes:
    """``n`` bytes of float32 weights (normal, std 0.02): what most of a bundle is."""
    rng = random.Random(seed)
    return array.array("f", (rng.gauss(0, 0.02) for _ in range(n // 4))).tobytes()


def _bfloat16(n: int) -> bytes:
    """``n`` bytes of bfloat16 weights: the upper half of each float32 (little-endian)."""
    f = _floats(2 * n)
    return b"".join(f[i + 2:i + 4] for i in range(0, len(f), 4))


def _token_ids(n: int, seed: int = 1) -> bytes:
    """``n`` bytes of int64 token ids below 50257: a batch of a language model."""
    rng = random.Random(seed)
    return array.array("q", (rng.randrange(50257) for _ in range(n // 8))).tobytes()


def _text(n: int) -> bytes:
    rng = random.Random(2)
    words = [b"step", b"loss", b"grad_norm", b"lr", b"\"module\"", b"tensor", b"0.0312", b"{", b"}", b"\n"]
    out = bytearray()
    while len(out) < n:
        out += rng.choice(words) + b" "
    return bytes(out[:n])


def _members(data: bytes) -> list[tuple[int, bytes]]:
    """Each member of a gzip stream as (deflate block type of its first block, the bytes it holds), parsed by hand."""
    out = []
    while data:
        assert data[:3] == b"\x1f\x8b\x08" and data[3] == 0, "a gzip header without name, comment or extra field"
        assert data[4:8] == bytes(4) and data[9] == 255, "mtime 0 and OS 'unknown': the same bytes everywhere"
        body = data[10:]
        d = zlib.decompressobj(-15)
        raw = d.decompress(body) + d.flush()
        assert d.eof
        crc, size = struct.unpack("<II", d.unused_data[:8])
        assert crc == zlib.crc32(raw) and size == len(raw)
        out.append(((body[0] >> 1) & 3, raw))
        data = d.unused_data[8:]
    return out


MIXED = _text(50_000) + _floats(300_000) + _token_ids(200_000) + _floats(70_000)


def _write(data: bytes, sizes: list[int], **kw) -> bytes:
    buf = io.BytesIO()
    with GzipMembers(buf, **kw) as gz:
        pos = 0
        for n in sizes:
            assert gz.write(data[pos:pos + n]) == len(data[pos:pos + n])
            pos += n
        gz.write(data[pos:])
        assert gz.tell() == len(data)
    return buf.getvalue()


@pytest.mark.parametrize("data", [b"", b"x", _text(3 * 4096), MIXED], ids=["empty", "one byte", "3 blocks", "mixed"])
def test_any_gzip_reader_reads_the_members_as_the_input(data):
    out = _write(data, [], block=4096)
    assert gzip.decompress(out) == data
    assert gzip.GzipFile(fileobj=io.BytesIO(out)).read() == data  # what reprokit's archive reader uses
    assert b"".join(raw for _, raw in _members(out)) == data
    assert len(_members(out)) == max(1, -(-len(data) // 4096)), "one member per block, one for an empty stream"


def test_the_bytes_depend_on_the_input_alone_not_on_write_sizes_or_threads():
    rng = random.Random(3)
    one = _write(MIXED, [], block=8192, workers=1)
    ragged = [rng.choice([1, 7, 511, 4096, 8191, 8192, 30_000]) for _ in range(60)]
    assert _write(MIXED, ragged, block=8192, workers=4) == one
    assert _write(MIXED, [8192] * 10, block=8192, workers=3) == one


def test_deflate_runs_only_where_it_saves_at_least_a_tenth_and_harder_where_it_saves_much():
    floats, bf16, ids, text = _floats(256 << 10), _bfloat16(256 << 10), _token_ids(256 << 10), _text(256 << 10)
    assert 0.85 < len(zlib.compress(floats, 6)) / len(floats) < 1, "float32 weights: deflate saves a few percent"
    assert [level_for(b) for b in (floats, bf16, ids, text)] == [0, 1, 6, 6]
    out = _write(floats + bf16 + ids + text, [], block=256 << 10)
    kinds = [kind for kind, _ in _members(out)]
    assert kinds[0] == 0 and all(k in (1, 2) for k in kinds[1:]), kinds  # stored, then deflated (Huffman coded)
    xfl = [m[8] for m in (member(floats), member(bf16), member(ids))]
    assert xfl == [0, 4, 0], "gzip's flag byte: 4 for level 1 (fastest), 0 for stored and level 6"
    stored = member(floats)
    assert len(stored) - len(floats) == 18 + 5 * -(-len(floats) // 0xFFFF), "stored: the bytes plus their framing"
    assert len(member(text)) < len(text) // 3 and len(member(text)) <= len(member(text, level=1))
    assert _members(member(text, level=0))[0][0] == 0, "level 0: always stored"
    assert member(text) == member(text, level=6) == _gzipfile(text), "level 6: what pack's GzipFile wrote before"


def _gzipfile(data: bytes) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=6) as f:
        f.write(data)
    return buf.getvalue()


def test_an_output_that_fails_stops_the_writer_and_its_threads(tmp_path):
    path = tmp_path / "out.gz"
    path.write_bytes(b"")
    with open(path, "rb") as read_only:  # a real file that refuses writes
        with pytest.raises(io.UnsupportedOperation), GzipMembers(read_only, block=4096, workers=2) as gz:
            gz.write(_text(64 << 10))
    assert gz.closed
    assert not [t for t in threading.enumerate() if t.name.startswith("reprokit-gzip")]
    with pytest.raises(ValueError, match="closed"):
        gz.write(b"more")


def test_the_default_block_is_read_when_the_writer_is_made(monkeypatch):
    monkeypatch.setattr(gzip_members, "BLOCK", 1000)
    out = _write(_text(2500), [])
    assert [len(raw) for _, raw in _members(out)] == [1000, 1000, 500]


def test_a_buffer_the_caller_reuses_is_copied_before_it_changes():
    """tarfile hands over bytes; a caller that refills one bytearray must still get what it wrote."""
    buf, reused = io.BytesIO(), bytearray(_text(3 * 4096))
    expected = bytes(reused)
    with GzipMembers(buf, block=4096, workers=2) as gz:
        gz.write(reused)
        reused[:] = bytes(len(reused))  # refilled before the workers are done
    assert gzip.decompress(buf.getvalue()) == expected
