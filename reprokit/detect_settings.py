"""Which detectors run after every step: :class:`DetectSettings`, stored in the bundle's run.json.

Apart from :mod:`reprokit.detect` (which imports torch) so that reading a bundle's run.json
(``reprokit inspect``, :mod:`reprokit.bundle.schema`) does not import torch. ``reprokit.detect`` re-exports it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from reprokit.errors import ConfigError


@dataclass(kw_only=True)
class DetectSettings:
    """Which detectors run after every step (stored in the bundle's run.json)."""

    check_loss: bool = True
    """Fail on a NaN/inf loss."""
    check_grads: bool = True
    """Fail on a non-finite global gradient norm, read in an optimizer step pre-hook (in the post-hook when
    ``step()`` is given a closure, which computes the step's gradients inside it: Lightning, LBFGS).
    Steps a GradScaler skips (overflow) do not count, and the norm is of the unscaled
    gradients, also with fused optimizers that unscale inside their own step."""
    check_params: bool = False
    """Fail on a non-finite parameter (reads every parameter each step)."""
    scaler_patience: int = 25
    """Fail after this many consecutive steps skipped by the GradScaler."""
    spike_factor: float | None = None
    """Opt-in: fail when loss > spike_factor x median of the last `spike_window` finite losses. Judged once
    there are 10 of them (or `spike_window`, if smaller): earlier steps are not; a median <= 0 is said once
    and judges nothing (a multiple of it is no bound)."""
    spike_window: int = 50
    """How many recent losses the spike median is taken over."""
    loss_from_mapping: bool = True
    """Read the loss of a step that returns a number, or a dict / ``ModelOutput`` (its ``"loss"`` entry). Bundles
    recorded before reprokit read those lack this key and replay with it off, as they were recorded (their
    failure was judged without that loss)."""

    def __post_init__(self) -> None:
        if self.scaler_patience < 1:
            raise ConfigError(f"scaler_patience must be >= 1, got {self.scaler_patience}")
        if self.spike_factor is not None and self.spike_factor <= 1:
            raise ConfigError(f"spike_factor must be > 1 (a multiple of the median loss), got {self.spike_factor}")
        if self.spike_window < 2:
            raise ConfigError(f"spike_window must be >= 2, got {self.spike_window}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
