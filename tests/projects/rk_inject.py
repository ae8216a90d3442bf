"""The rk_mlp project with faults injected at step 5 (reprokit.inject), one step function per fault."""

from __future__ import annotations

import rk_mlp

from reprokit.inject import FaultInjector

build = rk_mlp.build
batches = rk_mlp.batches

NAN_LOSS = FaultInjector("nan_loss", steps=[5])
INF_GRAD = FaultInjector("inf_grad", steps=[5])
EXCEPTION = FaultInjector("exception", steps=[5])
TRANSIENT = FaultInjector("transient_nan", steps=[5])


@NAN_LOSS.wrap
def nan_loss_step(state, batch):
    return rk_mlp.train_step(state, batch)


@INF_GRAD.wrap
def inf_grad_step(state, batch):
    return rk_mlp.train_step(state, batch)


@EXCEPTION.wrap
def exception_step(state, batch):
    return rk_mlp.train_step(state, batch)


@TRANSIENT.wrap
def transient_nan_step(state, batch):
    return rk_mlp.train_step(state, batch)
