"""A tiny model for the detector and extract edge cases (tests/integration/test_detect_returned_loss.py and
test_extract_module_alone.py).

``batch["returns"]`` picks what the step function returns: ``tensor`` (the loss), ``dict`` (``{"loss": loss}``,
as a Hugging Face ModelOutput holds it), ``tuple`` (``(loss, out)``) or ``negative`` (minus the loss). Rows of
zeros reaching :class:`Norm` make 0/0 = NaN there (``batches(..., zero_row=k)``); ``spike=(step, target)`` moves that
step's regression target far away (a loss spike); ``scale_at=(step, factor)`` scales that step's input.
"""

from __future__ import annotations

import types

import torch
from torch import nn

import reprokit
from reprokit.inject import FaultInjector


class Norm(nn.Module):
    """RMS norm without an epsilon floor worth the name: a row of zeros is 0/0."""

    def __init__(self, d: int, attr: str):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))
        # Its epsilon lives in a dict (plain data: an extract carries it) or in a namespace (it cannot).
        self.opts = {"eps": 0.0} if attr == "dict" else types.SimpleNamespace(eps=0.0)
        self.attr = attr

    def forward(self, x):
        if self.attr == "inplace":  # the same 0/0, made by an in-place division
            return (self.w * x).div_((x.pow(2).mean(-1, keepdim=True)).sqrt().detach())
        eps = self.opts["eps"] if self.attr == "dict" else self.opts.eps
        return self.w * x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


class Net(nn.Module):
    def __init__(self, attr: str):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.n = Norm(4, attr)
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        return self.b(self.n(self.a(x) * x[:, :1]))


class Root(nn.Module):
    """``|lin(x)|`` as ``sqrt(lin(x)^2)``: finite forward, but backward is 0 x inf = NaN where ``lin(x)`` is 0."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.lin(x).pow(2).sqrt()


class Twice(nn.Module):
    """Uses ``shared`` twice; ``gate = 0`` zeroes the second call's input, whose backward then makes the NaN."""

    def __init__(self, probe: bool = False):
        super().__init__()
        self.probe = probe
        self.inp = nn.Linear(4, 4)
        self.shared = Root(4)
        self.head = nn.Linear(4, 1)

    def forward(self, x, gate):
        out = self.head(self.shared(self.shared(self.inp(x)) * gate))
        if self.probe:  # a third call under no_grad (as a target network's): it gets no backward
            with torch.no_grad():
                self.shared(x)
        return out


def twice_step(state, batch):
    loss = state.model(batch["x"], batch["gate"]).pow(2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def twice_batches(steps, gate_off):
    g = torch.Generator().manual_seed(0)
    for i in range(steps):
        yield {"x": torch.randn(4, 4, generator=g), "gate": 0.0 if i == gate_off else 1.0}


class Tempered(nn.Module):
    """A softmax without the max subtraction whose temperature comes in an options object (not data)."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x, opts):
        e = torch.exp(self.lin(x) * opts.temperature)
        return e / e.sum(-1, keepdim=True)


class WithOptions(nn.Module):
    def __init__(self):
        super().__init__()
        self.soft = Tempered(4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.soft(x, types.SimpleNamespace(temperature=1.0)))


def build(config):
    torch.manual_seed(0)
    if config.get("model") == "options":
        opts = WithOptions()
        return reprokit.TrainState(model=opts, optimizer=torch.optim.SGD(opts.parameters(), lr=1e-3))
    if config.get("model") == "twice":
        twice = Twice(probe=config.get("probe", False))
        return reprokit.TrainState(model=twice, optimizer=torch.optim.SGD(twice.parameters(), lr=1e-3))
    model = Net(config.get("attr", "dict"))
    with torch.no_grad():
        model.a.bias.zero_()
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-2))


def train_step(state, batch):
    out = state.model(batch["x"])
    loss = (out - batch.get("target", 1.0)).pow(2).mean()
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    kind = batch.get("returns", "tensor")
    if kind == "dict":
        return {"loss": loss, "logits": out.detach()}
    if kind == "tuple":
        return loss, out.detach()
    if kind == "negative":
        return -loss
    return loss


def batches(steps, returns="tensor", zero_row=None, spike=None, scale_at=None):
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x = torch.randn(4, 4, generator=g)
        if i == zero_row:
            x[1, 0] = 0.0  # row 1 of a(x) * x[:, :1] is all zeros
        if scale_at is not None and i == scale_at[0]:
            x = x * scale_at[1]
        target = spike[1] if spike is not None and i == spike[0] else 1.0
        yield {"x": x, "returns": returns, "target": target}


def vector_verdict(step, loss, state):
    """A predicate that forgets .any(): a tensor of several values is neither true nor false."""
    return torch.tensor([loss > 100.0, step == 3])


def loss_above_100(step, loss, state):
    return loss is not None and loss > 100.0


@FaultInjector("nan_loss", steps=[3]).wrap
def nan_dict_step(state, batch):
    """Returns ``{"loss", "logits"}``; the loss reads NaN at step 3."""
    return train_step(state, {**batch, "returns": "dict"})
