"""One replay of a window, as the replayer and the isolated runner both report it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reprokit.signature import Failure


@dataclass
class RunOutcome:
    """One replay of a window.

    ``same`` is the verdict of this run: it failed with the recorded signature *at
    the recorded step*. A failure that is not ``same`` is a different failure.
    """

    failure: Failure | None
    same: bool
    losses: dict[int, float | None]
    seconds: float
    fidelity: dict[str, Any] | None = None
    """Set by :func:`replay`: this run's losses against the recorded ones (see ``Session.fidelity``)."""
    death: dict[str, Any] | None = None
    """For a run in a child process that died (see :mod:`reprokit.isolation`): how (``signal``, ``returncode``),
    the steps it had started and finished, its peak host memory and the last lines it wrote; ``failure`` is then a
    ``crash``."""

    @property
    def verdict(self) -> str:
        """``reproduced``, ``different_failure`` or ``passed``."""
        return "reproduced" if self.same else "different_failure" if self.failure else "passed"

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reproduced": self.same,
                "failure": self.failure.summary() if self.failure else None,
                "failure_step": self.failure.step if self.failure else None,
                "different_failure": bool(self.failure and not self.same), "seconds": round(self.seconds, 4),
                "steps_run": len(self.losses), "death": self.death,
                "fidelity": {k: self.fidelity[k] for k in ("bit_exact", "max_abs_diff", "first_diverging_step")}
                if self.fidelity else None,
                "losses": [{"step": k, "loss": v} for k, v in self.losses.items()]}


__all__ = ["RunOutcome"]
