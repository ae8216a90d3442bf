"""bisect layers' "already out of range" verdict: what counts as a value that grew, and what is only a fill."""

from __future__ import annotations

import torch
from torch import nn

import reprokit
from reprokit.bisect.growth import Growth


def tracker(norm_after: float) -> Growth:
    """A Growth over a real one-layer model whose parameter norms went from 1 to ``norm_after`` in step 0."""
    model = nn.Linear(2, 2)
    g = Growth(reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)), first_step=0)
    g.close()
    g.start = {"weight": 1.0, "bias": 1.0}
    g.after = {0: {"weight": norm_after, "bias": 1.0}}
    return g


def frame(abs_max: float) -> dict:
    return {"module": "attn.softmax", "class": "NaiveSoftmax", "phase": "forward", "inputs": {"abs_max": abs_max, "nonfinite": 0},
            "weights": None}


def test_a_mask_filled_with_finfo_min_is_no_value_out_of_range():
    fill = float(torch.finfo(torch.float32).max)  # |finfo.min|: Hugging Face's mask fill
    assert tracker(1.0).verdict(frame(fill), None, torch.float32, failing_step=1) is None
    assert tracker(1e6).verdict(frame(fill), None, torch.float32, failing_step=1) is None


def test_a_value_past_the_square_limit_counts_only_with_growth_behind_it():
    assert tracker(1.0).verdict(frame(1e20), None, torch.float32, failing_step=1) is None  # nothing grew
    v = tracker(1e6).verdict(frame(1e20), None, torch.float32, failing_step=1)
    assert v is not None and v["grew"]["parameter"] == "weight" and "can square" in v["why"][0], v
