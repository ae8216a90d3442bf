"""Naming an out-of-range index: the op that fails on it (checked before it runs, on the CPU) and where the value
sits in the batch (leaf, micro-batch, row, dataset index, position)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from reprokit.locate_index import IndexWatch, locate


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = torch.nn.ModuleDict({"wte": torch.nn.Embedding(50, 4)})
        self.head = torch.nn.Linear(4, 7)

    def forward(self, ids):
        return self.head(self.transformer["wte"](ids))


def watched(model, fn):
    with IndexWatch(model) as watch:
        with pytest.raises((IndexError, RuntimeError)):
            fn()
    assert watch.finding is not None
    return watch.finding


def test_an_id_past_the_embedding_names_the_module_the_row_the_position_and_the_dataset_index():
    net = Net()
    ids = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(0))
    ids[2, 4] = 50
    batch = {"input_ids": ids, "labels": ids.clone(), "index": torch.tensor([10, 11, 12, 13])}
    found = watched(net, lambda: net(batch["input_ids"]))
    assert (found["op"], found["value"], found["bound"], found["module"]) == ("embedding", 50, 50, "transformer.wte")
    where = locate(found, batch, 31204)
    # labels hold the same id at the same place: the id leaf, not the label leaf, fed the embedding
    assert (where["leaf"], where["row"], where["position"], where["dataset_index"]) == ("input_ids", 2, 4, 12)
    assert where["message"] == ("step 31204, input_ids row 2 (dataset index 12), position 4: id 50 >= num_embeddings "
                                "50 of transformer.wte")


def test_a_trainer_update_names_its_micro_batch_and_the_index_kept_beside_it():
    net = Net()
    micro = [{"inputs": {"input_ids": torch.zeros(2, 3, dtype=torch.long)}, "index": torch.tensor([5, 6])},
             {"inputs": {"input_ids": torch.tensor([[1, 2, 3], [4, 99, 6]])}, "index": torch.tensor([777, 778])}]
    batch = {"micro": micro}
    net(micro[0]["inputs"]["input_ids"])
    found = watched(net, lambda: net(micro[1]["inputs"]["input_ids"]))
    where = locate(found, batch, 8)
    assert where["message"] == ("step 8, micro 1, input_ids row 1 (dataset index 778), position 1: id 99 >= "
                                "num_embeddings 50 of transformer.wte")


def test_a_target_past_the_classes_is_found_in_the_labels_against_the_logits_class_dimension():
    net = Net()
    ids = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([1, 6, 7, -100])  # -100: the ignore index, never out of range
    batch = {"input_ids": ids, "labels": labels, "idx": torch.tensor([40, 41, 42, 43])}
    found = watched(net, lambda: F.cross_entropy(net(ids).mean(1), labels))
    assert (found["op"], found["value"], found["bound"], found["logits_shape"]) == ("cross_entropy", 7, 7, [4, 7])
    where = locate(found, batch, 3)
    assert where["message"] == "step 3, labels row 2 (dataset index 42): target 7 >= 7 classes of cross_entropy " \
                               "(logits 4x7)"


def test_a_loss_module_over_positions_and_a_negative_target_that_is_not_the_ignore_index():
    logits, target = torch.randn(2, 7, 5), torch.tensor([[0, 1, -3, 2, 3], [0] * 5])
    loss = torch.nn.CrossEntropyLoss()
    found = watched(torch.nn.ModuleDict({"loss": loss}), lambda: loss(logits, target))
    assert (found["value"], found["bound"], found["module"]) == (-3, 7, "loss")
    where = locate(found, {"labels": target}, 0)
    assert (where["row"], where["position"]) == (0, 2)
    assert "target -3 < 0 in cross_entropy, which is not its ignore_index -100 in loss" in where["message"]


@pytest.mark.parametrize("op, call", [
    ("gather", lambda x, i: torch.gather(x, 1, i)),
    ("gather", lambda x, i: x.gather(1, i)),
    ("index_select", lambda x, i: x.index_select(1, i[0])),
    ("indexing", lambda x, i: x[:, i[0]]),
    ("scatter", lambda x, i: x.clone().scatter_(1, i, 1.0)),
])
def test_index_ops_are_checked_against_the_size_of_their_dimension(op, call):
    x, i = torch.randn(2, 5), torch.tensor([[0, 5], [1, 2]])
    found = watched(None, lambda: call(x, i))
    assert (found["op"], found["value"], found["bound"], found["bound_name"]) == (op, 5, 5, "size of dim 1")


def test_an_index_computed_in_the_step_is_said_to_be_so():
    table = torch.nn.Embedding(8, 2)
    found = watched(table, lambda: table(torch.arange(9)))  # position ids past a position table
    where = locate(found, {"input_ids": torch.zeros(1, 9, dtype=torch.long)}, 4)
    assert where["leaf"] is None
    assert where["message"] == "step 4: id 8 >= num_embeddings 8 of <model> (no leaf of the batch holds it: the " \
                               "index was computed in the step)"


def test_a_disarmed_watch_checks_nothing_and_in_range_indices_give_no_finding():
    net = Net()
    with IndexWatch(net) as watch:
        net(torch.tensor([[1, 2]]))
        F.cross_entropy(torch.randn(2, 3), torch.tensor([0, 2]))
        watch.armed = False
        with pytest.raises(IndexError):
            net(torch.tensor([[50]]))
    assert watch.finding is None
    assert locate(None, {}, 0) is None
