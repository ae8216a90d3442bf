"""A project's own Hugging Face classes: a GPT-2 subclass and a Trainer with its own loss (for the transformers
integration tests: replay must import them from the bundle's code snapshot), and Trainers with their own optimizers."""

from __future__ import annotations

import torch
from transformers import GPT2LMHeadModel, Trainer


class ScaledGPT2(GPT2LMHeadModel):
    """GPT-2 whose logits are scaled by a constant (a project-specific head)."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
        out.logits = out.logits * 0.5
        return out


class MaskedMeanTrainer(Trainer):
    """Mean cross-entropy over the target tokens, counted by hand: 0 / 0 when a batch has none."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        logits = outputs.logits[:, :-1].float()
        target = labels[:, 1:]
        mask = target != -100
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.clamp(min=0).reshape(-1),
                                               reduction="none").reshape(target.shape)
        loss = (ce * mask).sum() / mask.sum()
        return (loss, outputs) if return_outputs else loss


class SGDTrainer(Trainer):
    """A Trainer that makes its own optimizer, SGD with momentum, in place of the arguments' AdamW."""

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = torch.optim.SGD((model or self.model).parameters(), lr=self.args.learning_rate,
                                             momentum=0.9)
        return self.optimizer


class TensorLRTrainer(Trainer):
    """A Trainer whose AdamW holds its LR as a tensor, which LR schedulers change in place."""

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW((model or self.model).parameters(),
                                               lr=torch.tensor(self.args.learning_rate), foreach=False)
        return self.optimizer
