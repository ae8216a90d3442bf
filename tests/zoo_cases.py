"""What each failure-zoo example prints when it runs (``--quick``); shared by test_examples and test_zoo.

test_zoo.py runs each of these scripts (its record step) and goes on with the bundle it wrote;
test_examples.py runs every other script in examples/ and checks that every script is listed
in one of the two places.

A failure step is pinned exactly only where the data decides it (the poisoned batch, the batch-size change, the LR
jump): that holds on every CPU. Where the training dynamics decide it (an accumulating gradient crossing a threshold,
a fraction of underflowed gradients passing 25%), the last float bits of a CPU's SIMD path (AVX2 or AVX-512, the
thread count) move it by a few steps, so ``STEPS`` gives the range every CPU must land in and the line leaves the step
out. torch's error texts are those of the torch these tests pin in CI (``QUOTED_TORCH``): another torch version words
its errors its own way, so there :func:`check_output` keeps only the kind of failure (and no step).
"""

from __future__ import annotations

import re

import torch

QUOTED_TORCH = "2.13."

ZOO = {
    "bad_batch.py": ["training failed: non-finite loss at step 45", "replay: deterministic, 3/3"],
    "oov_token.py": ["training raised: IndexError: index out of range in self", "replay: deterministic, 3/3"],
    "long_sample.py": ["training raised: IndexError: index out of range in self", "replay: deterministic, 3/3"],
    "empty_document.py": ["training failed: non-finite loss at step 29", "replay: deterministic, 3/3"],
    "collate_dtype.py": ["training raised: RuntimeError: expected target dtype to be Long", "replay: deterministic, 3/3"],
    "fp16_overflow.py": ["training failed: non-finite loss at step 55 (loss = inf)", "replay: deterministic, 3/3"],
    "lr_no_warmup.py": ["training failed: non-finite loss at step 16", "replay: deterministic, 3/3"],
    "naive_softmax.py": ["training failed: non-finite loss at step 25 (loss = nan)", "replay: deterministic, 3/3"],
    "nondeterministic.py": ["training failed: non-finite loss", "runs failed the same way"],
    "shuffled_labels.py": ["training failed: user predicate fired at step 39 (not_learning returned True)",
                           "replay: deterministic, 3/3"],
    "lr_x100.py": ["training failed: loss spike at step 64", "replay: deterministic, 3/3"],
    "missing_zero_grad.py": ["training failed: loss spike", "replay: deterministic, 3/3"],
    "sum_reduction.py": ["training failed: loss spike at step 40", "replay: deterministic, 3/3"],
    "autocast_no_scaler.py": ["training failed: user predicate fired", "(grads_underflow returned True)",
                              "replay: deterministic, 3/3"],
}

# Failure steps the training dynamics decide: each CPU lands somewhere in the range (seen: 146 on AVX2, 154 without
# vectorisation for missing_zero_grad; 175 on AVX2, 176 on AVX-512 for autocast_no_scaler).
STEPS = {
    "missing_zero_grad.py": range(120, 181),
    "autocast_no_scaler.py": range(150, 201),
}

_STEP = re.compile(r"^training (?:failed|raised)\b.* at step (\d+)", re.MULTILINE)


def expected_lines(script: str) -> list[str]:
    """What ``script --quick`` must print: ``ZOO[script]`` on the quoted torch; elsewhere each line up to its step
    number, or for an exception up to its type (``training raised: RuntimeError``)."""
    if torch.__version__.startswith(QUOTED_TORCH):
        return ZOO[script]
    kinds = []
    for line in ZOO[script]:
        if " at step " in line:
            line = line.split(" at step ")[0]
        elif line.startswith("training raised: "):
            line = ": ".join(line.split(": ")[:2])
        kinds.append(line)
    return kinds


def check_output(script: str, stdout: str) -> None:
    """Assert that ``script --quick`` printed its story: every expected line, and a failure step in ``STEPS``'s
    range where the dynamics decide it (on the quoted torch)."""
    for line in expected_lines(script):
        assert line in stdout, (line, stdout)
    if script in STEPS and torch.__version__.startswith(QUOTED_TORCH):
        m = _STEP.search(stdout)
        assert m is not None and int(m.group(1)) in STEPS[script], (STEPS[script], stdout)
