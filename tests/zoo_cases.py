"""What each failure-zoo example prints when it runs (``--quick``); shared by test_examples and test_zoo.

test_zoo.py runs each of these scripts (its record step) and goes on with the bundle it wrote;
test_examples.py runs every other script in examples/ and checks that every script is listed
in one of the two places.

The step numbers and torch's error texts are those of the torch these tests pin in CI (``QUOTED_TORCH``): another
torch version (the package accepts torch >= 2.4) reaches the same failure with other numerics, often at another
step, and words its errors its own way, so there :func:`expected_lines` keeps only the kind of failure.
"""

import torch

QUOTED_TORCH = "2.13."

ZOO = {
    "bad_batch.py": ["training failed: non-finite loss at step 45", "replay: deterministic, 3/3"],
    "oov_token.py": ["training raised: IndexError: index out of range in self", "replay: deterministic, 3/3"],
    "long_sample.py": ["training raised: IndexError: index out of range in self", "replay: deterministic, 3/3"],
    "empty_document.py": ["training failed: non-finite loss at step 29", "replay: deterministic, 3/3"],
    "collate_dtype.py": ["training raised: RuntimeError: expected target dtype to be Long", "replay: deterministic, 3/3"],
    "fp16_overflow.py": ["training failed: non-finite loss at step 55 (loss = inf)", "replay: deterministic, 3/3"],
    "lr_no_warmup.py": ["training failed: non-finite loss at step 95", "replay: deterministic, 3/3"],
    "naive_softmax.py": ["training failed: non-finite gradient norm at step 104", "replay: deterministic, 3/3"],
    "nondeterministic.py": ["training failed: non-finite loss", "runs failed the same way"],
    "shuffled_labels.py": ["training failed: user predicate fired at step 39 (not_learning returned True)",
                           "replay: deterministic, 3/3"],
    "lr_x100.py": ["training failed: loss spike at step 64", "replay: deterministic, 3/3"],
    "missing_zero_grad.py": ["training failed: loss spike at step 146", "replay: deterministic, 3/3"],
    "sum_reduction.py": ["training failed: loss spike at step 40", "replay: deterministic, 3/3"],
    "autocast_no_scaler.py": ["training failed: user predicate fired at step 175 (grads_underflow returned True)",
                              "replay: deterministic, 3/3"],
}


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
