"""The bisect axes and the precision variants, each listed once, here. No torch is imported: the command line reads
them for its help.

An axis that replays the bundle is one module of this package named after it, defining ``bisect_<name>(bundle, *,
device, code, **options)`` (a JSON-able dict) and ``format_<name>(result)`` (its text): see
:func:`reprokit.bisect.axis`. ``commits`` bisects git history instead and has a command of its own.
"""

from __future__ import annotations

AXES = {
    "steps": "the first step that went bad",
    "layers": "the first module",
    "precision": "the dtype or kernel that matters",
    "commits": "the first bad git commit",
}
"""Every axis, in the order the command line lists them, with what it finds."""
REPLAY_AXES = ("steps", "layers", "precision")
"""The axes that replay the bundle (one module each)."""

VARIANTS = {
    "recorded": "as recorded",
    "tf32_off": "TF32 matmuls and convolutions off (CUDA)",
    "tf32_on": "TF32 matmuls and convolutions on (CUDA)",
    "sdpa_math": "scaled_dot_product_attention on its math backend",
    "sdpa_flash": "scaled_dot_product_attention on its flash attention backend",
    "sdpa_efficient": "scaled_dot_product_attention on its memory-efficient backend",
    "sdpa_cudnn": "scaled_dot_product_attention on its cuDNN backend",
    "deterministic": "torch.use_deterministic_algorithms(True)",
    "bf16": "autocast to bfloat16",
    "fp16": "autocast to float16",
    "fp32": "float32: autocast off, parameters and optimizer state upcast",
}
"""Every precision and kernel variant ``bisect precision`` replays under, with what it changes. The order is also the
order of preference for "the smallest change that makes it pass": a kernel or flag switch before a change of
precision (:data:`reprokit.bisect.precision.VARIANTS` holds the context each one runs in)."""

