from __future__ import annotations

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
