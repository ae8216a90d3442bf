from __future__ import annotations

import sys

import pytest

from reprokit.signature import Failure, from_exception, normalise, same_failure


def raise_shape():
    raise RuntimeError("The size of tensor a (20) must match the size of tensor b (16) at dimension 1")


def raise_other():
    raise RuntimeError("The size of tensor a (3) must match the size of tensor b (2) at dimension 0")


def test_digits_are_normalised():
    assert normalise("index 17 is out of bounds for dim 0 with size 16") == \
        "index N is out of bounds for dim N with size N"


def test_signature_uses_the_raising_user_frame():
    with pytest.raises(RuntimeError) as a:
        raise_shape()
    f = from_exception(a.value, step=3)
    assert f.frame == "test_signature.py:raise_shape"
    assert f.signature()["message"].startswith("The size of tensor a (N)")


def test_same_failure_compares_kind_type_and_frame_not_numbers():
    with pytest.raises(RuntimeError) as a:
        raise_shape()
    with pytest.raises(RuntimeError) as b:
        raise_other()
    fa, fb = from_exception(a.value, 1), from_exception(b.value, 9)
    assert not fa.same_as(fb), "different raising function"
    fa2 = Failure(**{**fa.__dict__, "message": "The size of tensor a (7) must match ..."})
    assert fa.same_as(fa2)
    assert not same_failure(fa.signature(), None)
    nan = Failure("nonfinite_loss", 5, message="loss = nan")
    assert nan.same_as(Failure("nonfinite_loss", 2, message="loss = inf"))
    assert not nan.same_as(Failure("nonfinite_grad", 5))


def test_json_round_trip():
    f = Failure("exception", 4, exc_type="IndexError", message="m", frame="a.py:f", detail={"k": 1})
    assert Failure.from_json(f.to_json()) == f


class _Encoder:
    def forward(self):
        raise ValueError("shape 3 vs 4")


class _Decoder:
    def forward(self):
        raise ValueError("shape 3 vs 4")


def _raised_by(obj):
    try:
        obj.forward()
    except ValueError as e:
        return from_exception(e, 3)
    raise AssertionError("did not raise")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="a frame's qualified name (co_qualname) is Python 3.11+")
def test_two_classes_forward_in_one_file_are_two_places():
    enc, dec = _raised_by(_Encoder()), _raised_by(_Decoder())
    assert enc.frame == dec.frame == "test_signature.py:forward"
    assert enc.frame_qualname == "test_signature.py:_Encoder.forward"
    assert not enc.same_as(dec) and enc.same_as(_raised_by(_Encoder()))
    old = enc.to_json()  # a bundle written before the qualified name was recorded: the function's name decides
    del old["frame_qualname"], old["signature"]["frame_qualname"]
    assert Failure.from_json(old).same_as(dec) and dec.same_as(old)
