"""The ``on_failure`` options: checked at attach time, naming the option; and the batch surgery a skip's evidence
uses (a batch holding only some rows of another, in its shapes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import reprokit
from reprokit.shrink.batch import mask_rows, mix_rows


def build(config):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def train_step(state, batch):
    loss = state.model(batch["x"]).pow(2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss


@pytest.mark.parametrize(("option", "value", "words"), [
    ("on_failure", "continue", "on_failure must be one of 'raise', 'skip', got 'continue'"),
    ("skip_budget_s", 0, "skip_budget_s must be a positive number of seconds, got 0"),
    ("skip_budget_s", float("inf"), "skip_budget_s must be a positive number of seconds, got inf"),
    ("max_skips", 0, "max_skips must be an integer >= 1, got 0"),
    ("skip_window", 2.5, "skip_window must be an integer >= 1, got 2.5"),
    ("skip_indices", [1, 2.5], "skip_indices holds dataset indices: ints (or strings, for string ids); got 2.5"),
    ("skip_indices", "17", "skip_indices must be a collection of dataset indices, got '17'"),
])
def test_a_bad_skip_option_is_refused_naming_it_before_anything_is_attached(tmp_path, option, value, words):
    state = build({})
    with pytest.raises(reprokit.ConfigError) as e:
        reprokit.Recorder(state, train_step, build=build, config={}, out_dir=tmp_path, **{option: value})
    assert str(e.value) == words
    assert "--" + option.replace("_", "-") in e.value.cli_message
    assert not state.optimizer._optimizer_step_pre_hooks and not state.optimizer._optimizer_step_post_hooks


SEEN: list = []


def seeing_step(state, batch):
    SEEN.append(batch["index"].tolist() if "index" in batch else len(batch["x"]))
    return train_step(state, batch)


def test_skip_indices_drop_rows_by_dataset_index_and_a_batch_without_one_is_used_as_it_is(tmp_path):
    state = build({})
    SEEN.clear()
    rec = reprokit.Recorder(state, seeing_step, build=build, config={}, out_dir=tmp_path, skip_indices=torch.tensor([5, 2]))
    rec.step({"x": torch.randn(4, 4), "index": torch.tensor([0, 1, 2, 3])})
    rec.step({"x": torch.randn(4, 4), "index": torch.tensor([4, 5, 6, 7])})
    with pytest.warns(reprokit.RecorderWarning, match="carries no dataset index"):
        rec.step({"x": torch.randn(4, 4)})
    rec.close()
    assert SEEN == [[0, 1, 3], [4, 6, 7], 4]


def test_mix_rows_keeps_the_chosen_rows_in_the_donors_shapes():
    batch = {"x": torch.arange(8.0).reshape(4, 2), "index": torch.tensor([10, 11, 12, 13]), "scale": torch.tensor(3.0),
             "names": ["a", "b", "c", "d"]}
    donor = {"x": -torch.ones(4, 2), "index": torch.tensor([20, 21, 22, 23]), "scale": torch.tensor(9.0),
             "names": ["w", "x", "y", "z"]}
    out = mix_rows(batch, donor, 4, [1, 3])
    assert out["x"].tolist() == [[-1, -1], [2, 3], [-1, -1], [6, 7]]
    assert out["index"].tolist() == [20, 11, 22, 13] and out["names"] == ["w", "b", "y", "d"]
    assert out["scale"].item() == 3.0  # not a row of anything: the batch's own
    assert mix_rows(batch, {**donor, "x": torch.zeros(4, 3)}, 4, [1]) is None  # another shape: no mix


def test_mask_rows_neutralises_every_other_row_and_keeps_indices():
    batch = {"ids": torch.tensor([[5, 6], [7, 8], [9, 4]]), "x": torch.ones(3, 2), "index": torch.tensor([0, 1, 2])}
    out = mask_rows(batch, 3, [2], pad_id=1)
    assert out["ids"].tolist() == [[1, 1], [1, 1], [9, 4]]
    assert out["x"].tolist() == [[0, 0], [0, 0], [1, 1]]
    assert out["index"].tolist() == [0, 1, 2]


@pytest.mark.slow
def test_the_lightning_callback_refuses_skip_at_construction():
    pytest.importorskip("lightning")
    from reprokit.integrations.lightning import ReprokitCallback

    with pytest.raises(reprokit.ConfigError, match=r"on_failure='skip' is not supported through the Lightning callback"):
        ReprokitCallback(out_dir="repros", on_failure="skip")
    with pytest.raises(reprokit.ConfigError, match="on_failure must be one of 'raise', 'skip'"):
        ReprokitCallback(out_dir="repros", on_failure="bogus")
    ReprokitCallback(out_dir="repros", on_failure="raise")
