"""The README's Python API sketch (AdamW) with one inf in a sample: where does `bisect layers` say the value came
from? Found following the README as a newcomer: a loss of inf cannot come from the NaN AdamW makes of it later."""

from __future__ import annotations

import json
import textwrap

import pytest
from click.testing import CliRunner
from rk_testing import bundle_of, record

from reprokit.cli import main

PROJECT = textwrap.dedent('''
    import torch
    import reprokit

    def build(config):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))

    def train_step(state, batch):
        loss = ((state.model(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean()
        loss.backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
        return loss

    def batches(n, bad_step):
        g = torch.Generator().manual_seed(1)
        for i in range(n):
            x = torch.randn(16, 8, generator=g)
            if i == bad_step:
                x[3, 2] = float("inf")
            yield {"x": x, "y": torch.randn(16, generator=g)}
''')


@pytest.mark.slow
def test_an_inf_in_the_batch_is_not_blamed_on_the_optimizer(tmp_path, monkeypatch):
    (tmp_path / "nb_adam_inf.py").write_text(PROJECT)
    monkeypatch.syspath_prepend(str(tmp_path))
    import nb_adam_inf as m

    _, exc = record(m, {}, m.batches(8, bad_step=6), tmp_path / "repros", snapshot_every=4)
    res = CliRunner().invoke(main, ["bisect", "layers", str(bundle_of(exc)), "--json"])
    d = json.loads(res.stdout)
    assert res.exit_code == 0, res.output
    first = d["first_nonfinite"]
    # What happened: the Linear's forward received the batch's inf (inputs already non-finite) and that went on
    # to the loss. Nothing after it (the NaN that AdamW's addcdiv_ makes of inf/inf) is where it came from.
    assert (first["class"], first["phase"], first["inputs_already_nonfinite"]) == ("Linear", "forward", True)
    assert d["origin"] is None or d["origin"]["phase"] != "optimizer", d["origin"]
    assert d["origin"]["rows"] == [3] and not d["origin"]["created"], d["origin"]  # the row that held the inf
