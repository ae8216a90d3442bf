"""What each failure-zoo example prints when it runs (``--quick``); shared by test_examples and test_zoo.

test_zoo.py runs each of these scripts (its record step) and goes on with the bundle it wrote;
test_examples.py runs every other script in examples/ and checks that every script is listed
in one of the two places.
"""

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
