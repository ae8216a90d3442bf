"""Small models whose failure sits in one module, for `reprokit extract`.

``softmax``: a hand-written softmax without the max subtraction; large logits overflow exp to inf and
inf / inf is NaN (a forward failure). ``fp16``: two fp16 Linears under a manual loss scale; at the poisoned
step the scale makes the second one's backward overflow fp16 (a backward failure; its forward is finite).
"""

from __future__ import annotations

import torch
from torch import nn

import reprokit


class UnstableSoftmax(nn.Module):
    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        e = torch.exp(x)
        return e / e.sum(self.dim, keepdim=True)


class Net(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.attn = UnstableSoftmax()
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.attn(self.proj(x)))


def build(config):
    torch.manual_seed(config.get("seed", 0))
    d = config.get("d", 16)
    if config.get("model") == "fp16":
        model = nn.Sequential(nn.Linear(d, d), nn.Linear(d, d)).half()
        with torch.no_grad():
            model[1].weight.fill_(0.1)
    else:
        model = Net(d)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))


def train_step(state, batch):
    x = batch["x"].to(next(state.model.parameters()).dtype)
    out = state.model(x).float()
    if "loss_scale" in batch:  # a manual loss scale, too large at the poisoned step
        loss = out.mean()
        (out.sum() * batch["loss_scale"]).backward()
    else:
        loss = out.pow(2).mean()
        loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(config, steps, poison_step=None):
    g = torch.Generator().manual_seed(config.get("seed", 0) + 3)
    d = config.get("d", 16)
    for s in range(steps):
        x = torch.randn(4, d, generator=g)
        b = {"x": x}
        if config.get("model") == "fp16":
            b["loss_scale"] = 60000.0 if s == poison_step else 1.0
        elif s == poison_step:
            x[2] *= 1000.0  # one sample with huge activations
        yield b
