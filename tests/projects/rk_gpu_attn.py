"""A CUDA attention model trained under fp16 autocast with a GradScaler, whose activations overflow fp16."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import reprokit


class Attn(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, 1)
        self.heads = heads

    def forward(self, x):  # x: [B, T, 16]
        h = self.inp(x)
        b, t, d = h.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(h).split(d, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        return self.out(y + h).squeeze(-1)


def build(config):
    torch.manual_seed(0)
    model = Attn().to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return reprokit.TrainState(model=model, optimizer=opt, scaler=torch.amp.GradScaler("cuda"))


def train_step(state, batch):
    with torch.autocast("cuda", dtype=torch.float16):
        pred = state.model(batch["x"])
    loss = F.mse_loss(pred.float(), batch["y"])
    state.scaler.scale(loss).backward()
    state.scaler.step(state.optimizer)
    state.scaler.update()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def batches(steps, overflow_from):
    g = torch.Generator(device="cuda").manual_seed(9)
    for s in range(steps):
        x = torch.randn(4, 32, 16, device="cuda", generator=g)
        y = torch.tanh(x.sum(-1))
        if s >= overflow_from:
            x = x * 3e4  # activations past fp16's 65504
        yield {"x": x, "y": y}
