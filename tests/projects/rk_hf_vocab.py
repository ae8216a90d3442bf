"""A Hugging Face ``Trainer`` run (a 4-layer GPT-2 config made in code) where one dataset sample holds a token id
equal to the vocabulary size: a device-side assert on the GPU, an ``IndexError`` on the CPU.

``GpuFaceTrainer`` raises, with ``RK_GPU_FACE=1`` in the environment, what the GPU raises in place of the CPU's
IndexError (how the tests record the device error on a machine without a GPU; replay runs without it). The
recording runs in a process of its own: ``python -c "import rk_hf_vocab; rk_hf_vocab.main(...)"`` prints one JSON line.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from reprokit.integrations.transformers import ReprokitCallback

VOCAB, SEQ, ROWS = 1000, 16, 32
GPU_FACE = "CUDA error: device-side assert triggered"


class Tokens(torch.utils.data.Dataset):
    """``ROWS`` seeded token rows; row ``bad`` holds the id ``VOCAB`` at position ``pos``."""

    def __init__(self, bad: int, pos: int = 7):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        self.ids[bad, pos] = VOCAB

    def __len__(self) -> int:
        return ROWS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clamp(max=VOCAB - 1)}


class GpuFaceTrainer(Trainer):
    def training_step(self, model, inputs, num_items_in_batch=None):
        try:
            return super().training_step(model, inputs, num_items_in_batch)
        except IndexError:
            if os.environ.get("RK_GPU_FACE"):
                raise RuntimeError(GPU_FACE) from None
            raise


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=2,
                                      bos_token_id=0, eos_token_id=0))


def main(out_dir, device="cuda", bad=21, max_steps=8, snapshot_every=4, trainer_cls=Trainer):
    """Train until the bad sample's update fails; print ``{"bundle", "error", "failed_seconds"}``."""
    on_gpu = device == "cuda"
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=max_steps,
                             seed=3, report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True,
                             learning_rate=1e-3, bf16=on_gpu, use_cpu=not on_gpu)
    trainer = trainer_cls(model=model(), args=args, train_dataset=Tokens(bad),
                          callbacks=[ReprokitCallback(out_dir=out_dir, snapshot_every=snapshot_every)])
    t0 = time.perf_counter()
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - what the run ended with is the report
        notes = [n for n in getattr(e, "__notes__", []) if n.startswith("reprokit: bundle written to ")]
        rec = next(c for c in trainer.callback_handler.callbacks if isinstance(c, ReprokitCallback)).recorder
        print(json.dumps({"bundle": notes[-1].removeprefix("reprokit: bundle written to ") if notes else None,
                          "error": f"{type(e).__name__}: {str(e).splitlines()[0]}",
                          "write_seconds": getattr(rec, "dead_write_seconds", None),
                          "train_seconds": time.perf_counter() - t0}), flush=True)
        return
    print(json.dumps({"bundle": None, "error": None}), flush=True)
