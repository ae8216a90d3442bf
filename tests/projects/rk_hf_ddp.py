"""A stock Trainer run under torchrun (2 CPU ranks, gloo), recorded by ReprokitCallback alone.

    python -m torch.distributed.run --nproc_per_node 2 rk_hf_ddp.py OUT_DIR

Rank 0's data holds a token id past the vocabulary (sample 4: an IndexError in its forward at update 1); rank 1 is then
blocked in the gradient all-reduce, so its window is written as the incident's ``peer`` bundle.
"""

from __future__ import annotations

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from reprokit.integrations.transformers import ReprokitCallback

VOCAB, SEQ = 48, 8


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(1, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        ids = self.ids[i].clone()
        labels = ids.clone()
        if i == 4:
            ids[3] = VOCAB + 5
        return {"input_ids": ids, "labels": labels}


def main(out: str) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=f"{out}/trainer", per_device_train_batch_size=2, max_steps=4, seed=3,
                             use_cpu=True, report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True,
                             train_sampling_strategy="sequential")
    Trainer(model=model, args=args, train_dataset=Tokens(),
            callbacks=[ReprokitCallback(out_dir=f"{out}/repros", incident_wait_s=30)]).train()


if __name__ == "__main__":
    main(sys.argv[1])
