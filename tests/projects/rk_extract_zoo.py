"""Small models whose failure sits in one module, for `reprokit extract`.

``softmax``: a hand-written softmax without the max subtraction; large logits overflow exp to inf and
inf / inf is NaN (a forward failure). ``fp16``: two fp16 Linears under a manual loss scale; at the poisoned
step the scale makes the second one's backward overflow fp16 (a backward failure; its forward is finite).
``bad_backward``: a hand-written linear (a custom autograd Function) whose backward forgets a transpose: one
aten op (``mm``) raises a shape error in backward. ``guarded``: a custom Function whose backward raises a
Python ``ValueError`` itself when the gradient is too large (at the poisoned step): no aten op raised it.
``masked``: a module that drops outlier rows by masking them with ``-inf`` before a functional softmax; a
fully masked row is NaN, made inside that module, but first seen by the module hooks at its child ``proj``
(whose input was already NaN). ``loss_view``: the step function regroups the outputs with a wrong count at
the poisoned step, so ``aten.view`` raises outside every module.
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


class _BadGradMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, x.t() @ g  # the bug: g @ w.t()


class HandLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out) / d_in**0.5)

    def forward(self, x):
        return _BadGradMatmul.apply(x, self.weight)


class _GradGuard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, limit):
        ctx.limit = float(limit)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if float(g.abs().max()) > ctx.limit:
            raise ValueError("gradient too large for the guarded layer")
        return g, None


class Guarded(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("limit", torch.tensor(1e3))

    def forward(self, x):
        return _GradGuard.apply(x, self.limit)


class MaskedMix(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        outlier = x.norm(dim=-1, keepdim=True) > 100
        w = torch.nn.functional.softmax(x.masked_fill(outlier, float("-inf")), dim=-1)
        return self.proj(w * x.clamp(-1, 1))


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
    elif config.get("model") == "bad_backward":
        model = nn.Sequential(nn.Linear(d, d), HandLinear(d, d // 2))
    elif config.get("model") == "guarded":
        model = nn.Sequential(nn.Linear(d, d), Guarded(), nn.Linear(d, 1))
    elif config.get("model") == "masked":
        model = nn.Sequential(MaskedMix(d), nn.Linear(d, 1))
    else:
        model = Net(d)
    return reprokit.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))


def train_step(state, batch):
    x = batch["x"].to(next(state.model.parameters()).dtype)
    out = state.model(x).float()
    if "rows" in batch:  # the loss regroups the outputs: a wrong group count raises in the step function
        out = out.reshape(batch["rows"], -1)
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
        if config.get("model") == "loss_view":
            b["rows"] = 3 if s == poison_step else 4
        elif config.get("model") in ("fp16", "guarded"):
            b["loss_scale"] = 60000.0 if s == poison_step else 1.0
        elif s == poison_step:
            x[2] *= 1000.0  # one sample with huge activations
        yield b
