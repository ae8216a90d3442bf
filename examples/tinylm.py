"""The tiny models and the one training loop the failure zoo shares.

`TinyLM` is a decoder-only transformer (token + learned position embeddings,
pre-norm blocks of causal self-attention and an MLP, a tied output head) small
enough to train on a CPU in milliseconds a step; `MLP` is the model of the
non-language examples. `run_example` is the loop every example ends with: train
under a `reprokit.Recorder` until it fails, print what failed and where the
bundle is, and replay the bundle twice.

    python examples/tinylm.py [--quick]     # the healthy baseline: the LM learns a copy task
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

import reprokit


class Softmax(nn.Module):
    """torch.softmax, as a module so that `reprokit bisect layers` can name it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, softmax: nn.Module):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.softmax = softmax
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        attn = self.softmax(scores.masked_fill(~causal, float("-inf")))
        x = x + self.proj((attn @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A decoder-only transformer LM: ids [batch, seq] -> logits [batch, seq, vocab]."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 2, layers: int = 2, max_len: int = 32,
                 softmax: Callable[[], nn.Module] = Softmax):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)   # the position table: max_len positions, no more
        self.blocks = nn.ModuleList(Block(dim, heads, softmax()) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.T


def MLP(dim: int, hidden: int, out: int) -> nn.Sequential:  # noqa: N802 - reads like the class it builds
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, out))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy."""
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def parse(doc: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, for the test suite")
    ap.add_argument("--out", default=None, help="folder for the bundle (default: a temp folder)")
    return ap.parse_args()


def run_example(args: argparse.Namespace, state: reprokit.TrainState, train_step: Callable, build: Callable,
                config: dict[str, Any], batches: Iterable[Any], *, replays: int = 3,
                expect: Callable[[str], bool] = lambda verdict: verdict == "deterministic", **recorder: Any) -> int:
    """Train under a Recorder until it fails; print the failure and the bundle; replay it ``replays`` times.

    Returns the exit status: 0 when the run failed and the replay verdict is what ``expect`` wants.
    """
    out = args.out or tempfile.mkdtemp(prefix="reprokit-example-")
    rec = reprokit.Recorder(state, train_step, build=build, config=config, out_dir=out, **recorder)
    try:
        for batch in batches:
            rec.step(batch)
    except reprokit.TrainingFailure as e:
        print(f"training failed: {e.failure.describe()}")
    except Exception as e:  # the step's own exception, re-raised unchanged by the recorder
        print(f"training raised: {type(e).__name__}: {e}")
    else:
        print("training finished without failing (unexpected)")
        return 1
    bundle = rec.bundles[-1]
    print(f"bundle: {bundle}")
    report = reprokit.replay(bundle, times=replays)
    print(f"replay: {report.verdict}, {report.failed_runs}/{len(report.runs)} runs failed the same way")
    return 0 if expect(report.verdict) else 1


# --- the healthy baseline ------------------------------------------------------------------------

def build(config: dict[str, Any]) -> reprokit.TrainState:
    torch.manual_seed(config["seed"])
    model = TinyLM(vocab=config["vocab"], max_len=config["max_len"])
    return reprokit.TrainState(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=config["lr"]))


def train_step(state: reprokit.TrainState, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss = lm_loss(state.model(batch["input_ids"]), batch["input_ids"])
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def main() -> int:
    args = parse(__doc__)
    config = {"seed": 0, "vocab": 16, "max_len": 32, "lr": 3e-3}
    state = build(config)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(60 if args.quick else 600):
        half = torch.randint(1, config["vocab"], (16, 16), generator=g)
        losses.append(float(train_step(state, {"input_ids": torch.cat([half, half], 1)}).detach()))  # copy
    print(f"TinyLM ({sum(p.numel() for p in state.model.parameters())} parameters): "
          f"loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    return 0 if losses[-1] < losses[0] * 0.9 else 1


if __name__ == "__main__":
    raise SystemExit(main())
