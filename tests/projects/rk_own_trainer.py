"""A third framework integration, written against reprokit's public interface only: a trainer that owns its loop
drives the Recorder with ``begin_step``/``end_step``, asks for a snapshot after an LR change made between steps
(``request_snapshot``), and carries the model class that its ``build`` names through the config (``carry``)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

import reprokit


def _model_class(ref: dict[str, str]) -> type:
    return getattr(importlib.import_module(ref["module"]), ref["qualname"])


def build(config: dict[str, Any]) -> reprokit.TrainState:
    torch.manual_seed(0)
    model = _model_class(config["model"])(config.get("width", 8))
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1)))


def train_step(state: reprokit.TrainState, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """What the trainer does in one step (replay runs this on each recorded batch)."""
    loss = torch.nn.functional.mse_loss(state.model(batch["x"]), batch["y"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return loss


class OwnTrainer:
    """The framework: its own loop, its own events; reprokit sees only what the public interface gives it."""

    def __init__(self, model_class: type, out_dir: Any, **recorder_options: Any):
        self.config = {"model": {"module": model_class.__module__, "qualname": model_class.__qualname__}}
        self.state = build(self.config)
        self.recorder = reprokit.Recorder(self.state, train_step, build=build, config=self.config, out_dir=out_dir,
                                          carry=(model_class,), **recorder_options)

    def fit(self, batches: list[dict[str, torch.Tensor]], lr_cut_at: int | None = None) -> None:
        rec = self.recorder
        for i, batch in enumerate(batches):
            if i == lr_cut_at:  # an LR change between steps, which train_step cannot replay
                for group in self.state.optimizer.param_groups:
                    group["lr"] *= 0.5
                rec.request_snapshot()
            rec.begin_step(batch)
            try:
                loss = train_step(self.state, batch)
            except Exception as e:  # noqa: BLE001 - the recorder writes the bundle and re-raises e unchanged
                rec.end_step(exc=e)
                raise
            rec.end_step(loss)


def batches(n: int, poison_step: int | None = None) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        x = torch.randn(8, 4, generator=g)
        if i == poison_step:
            x[5, 2] = float("nan")
        out.append({"x": x, "y": x.sum(1, keepdim=True)})
    return out
