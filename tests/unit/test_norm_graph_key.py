"""The key a gradient-norm CUDA graph is replayed under (reprokit.norm_graph.grads_key): two lists of gradients share
a key only when they cover the same memory the same way; the GPU tests check the replays themselves."""

from __future__ import annotations

import torch

from reprokit.norm_graph import grads_key


def test_the_same_tensors_share_a_key_and_every_other_layout_of_the_same_memory_does_not():
    base = torch.randn(64)
    key = grads_key([[base[:32]], [base[32:].view(4, 8)]])
    assert grads_key([[base[:32]], [base[32:].view(4, 8)]]) == key  # new views, same memory, same layout
    others = [
        [[base[:32]], [base[32:]]],                        # other shape
        [[base[:32]], [base[32:].view(8, 4).t()]],         # other strides
        [[base[:16]], [base[32:].view(4, 8)]],             # fewer elements at the same address
        [[base[32:].view(4, 8)], [base[:32]]],             # other order
        [[base[:32], base[32:].view(4, 8)]],               # other grouping (each group is normed apart)
        [[base[:32].clone()], [base[32:].view(4, 8)]],     # other address
        [[base[:32].double()], [base[32:].view(4, 8)]],    # other dtype
    ]
    assert all(grads_key(g) != key for g in others)
