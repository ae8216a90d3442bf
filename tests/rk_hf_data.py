"""A tiny GPT-2 and a dataset of ``inputs_embeds`` for the HF Trainer tests (one NaN row on request)."""

from __future__ import annotations

import rk_hf_guard  # noqa: F401 - skips the importing test module where transformers has no torch
import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB, SEQ, D = 48, 8, 16


class Embeds(torch.utils.data.Dataset):
    """``n`` rows of ``inputs_embeds`` (and labels); row ``bad`` holds a NaN, which only that update's loss sees."""

    def __init__(self, n: int, bad: int | None = None):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, SEQ, D, generator=g)
        self.y = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        if bad is not None:
            self.x[bad, 2, 3] = float("nan")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"inputs_embeds": self.x[i], "labels": self.y[i]}


def tiny() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=D, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0))
