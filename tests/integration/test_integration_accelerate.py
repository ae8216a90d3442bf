"""accelerate: a loop over a prepared model, optimizer, scheduler and dataloader records and replays."""

from __future__ import annotations

import json

import accelerate  # noqa: F401  the test extra installs it: a missing one must fail, not skip
import pytest
from click.testing import CliRunner
from rk_testing import bundle_of, record

from reprokit.bundle import open_bundle
from reprokit.cli import main

pytestmark = pytest.mark.slow  # importing accelerate alone takes seconds


def test_a_prepared_loop_records_its_wrapped_optimizer_and_replays_bit_exact(projects, tmp_path):
    from accelerate.optimizer import AcceleratedOptimizer
    from accelerate.scheduler import AcceleratedScheduler

    acc = projects("rk_accelerate")
    state = acc.build({})
    assert isinstance(state.optimizer, AcceleratedOptimizer) and isinstance(state.scheduler, AcceleratedScheduler)
    batches = acc.loader(poison=21)  # sample 21: batch 5
    rec, exc = record(acc, {}, batches, tmp_path / "repros", snapshot_every=3)
    # The gradient check hooks the optimizer inside the wrapper: it is what fires here (the loss stays finite).
    assert exc.failure.kind == "nonfinite_grad" and exc.failure.step == 5
    b = open_bundle(bundle_of(exc))
    assert b.run["window"]["steps"] == [3, 4, 5]
    assert b.state()[0]["state"]["scheduler"] is not None
    out = CliRunner().invoke(main, ["replay", str(b.path), "--json"])
    assert out.exit_code == 1, out.output
    d = json.loads(out.output)
    assert d["verdict"] == "deterministic" and d["fidelity"]["bit_exact"] and d["fidelity"]["steps_compared"] == 3
    rec.close()


def test_the_wrapper_still_runs_around_the_step_while_recording(projects, tmp_path):
    """reprokit hooks the inner optimizer but the step function keeps calling accelerate's wrapper."""
    acc = projects("rk_accelerate")
    state = acc.build({})
    calls = []
    real_step = type(state.optimizer).step

    def counting(self, *a, **kw):
        calls.append(self)
        return real_step(self, *a, **kw)

    state.optimizer.step = counting.__get__(state.optimizer)
    import reprokit

    rec = reprokit.Recorder(state, acc.train_step, build=acc.build, config={}, out_dir=tmp_path / "r")
    for batch in list(acc.loader(n=8)):
        rec.step(batch)
    rec.close()
    assert calls == [state.optimizer, state.optimizer]
