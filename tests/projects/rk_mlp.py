"""A small regression project used by the tests: every optimizer, scheduler and scaler path."""

from __future__ import annotations

import functools

import torch
from torch import nn

import reprokit
from reprokit.detect import lagged

OPTIMIZERS = {
    "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9, nesterov=True),
    "adam": lambda p, lr: torch.optim.Adam(p, lr=lr),
    "adamw": lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.01),
    "adamw_amsgrad": lambda p, lr: torch.optim.AdamW(p, lr=lr, amsgrad=True),
    "rmsprop": lambda p, lr: torch.optim.RMSprop(p, lr=lr, momentum=0.5, centered=True),
    "adagrad": lambda p, lr: torch.optim.Adagrad(p, lr=lr),
    "adadelta": lambda p, lr: torch.optim.Adadelta(p, lr=lr),
    "adamax": lambda p, lr: torch.optim.Adamax(p, lr=lr),
    "nadam": lambda p, lr: torch.optim.NAdam(p, lr=lr),
    "radam": lambda p, lr: torch.optim.RAdam(p, lr=lr),
    "asgd": lambda p, lr: torch.optim.ASGD(p, lr=lr),
    "rprop": lambda p, lr: torch.optim.Rprop(p, lr=lr),
    "lbfgs": lambda p, lr: torch.optim.LBFGS(p, lr=lr, history_size=3, max_iter=2),
}


def warmup(step: int, steps: int) -> float:
    return min(1.0, (step + 1) / steps)


def jump(step: int, at: int) -> float:
    """A schedule with a bug: the LR is multiplied by 1e24 from step ``at`` on (any batch overflows after it)."""
    return 1.0 if step < at else 1e24


def make_scheduler(name, opt, total):
    S = torch.optim.lr_scheduler
    if name is None:
        return None
    if name == "lambda":
        return S.LambdaLR(opt, functools.partial(warmup, steps=5))
    if name == "jump":
        return S.LambdaLR(opt, functools.partial(jump, at=6))
    if name == "step":
        return S.StepLR(opt, step_size=3, gamma=0.5)
    if name == "cosine":
        return S.CosineAnnealingLR(opt, T_max=total)
    if name == "onecycle":
        return S.OneCycleLR(opt, max_lr=0.05, total_steps=total + 5)
    if name == "sequential":
        return S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.1, total_iters=4), S.StepLR(opt, 3)],
                              milestones=[4])
    raise ValueError(name)


class Tied(nn.Module):
    """Input and output projections share one weight matrix."""

    def __init__(self, d: int):
        super().__init__()
        self.inp = nn.Linear(d, d, bias=False)
        self.mid = nn.Linear(d, d)
        self.out = nn.Linear(d, d, bias=False)
        self.out.weight = self.inp.weight
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        return self.head(self.out(torch.tanh(self.mid(self.inp(x)))))


def build(config):
    torch.manual_seed(config.get("seed", 0))
    d = config.get("dim", 8)
    if config.get("tied"):
        model = Tied(d)
    else:
        model = nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = OPTIMIZERS[config.get("optimizer", "adamw")](model.parameters(), config.get("lr", 1e-2))
    sched = make_scheduler(config.get("scheduler"), opt, config.get("steps", 50))
    scaler = torch.amp.GradScaler("cpu", init_scale=config.get("init_scale", 2.0**8)) if config.get("scaler") else None
    extra = {"calls": 0} if config.get("count") else {}
    return reprokit.TrainState(model=model, optimizer=opt, scheduler=sched, scaler=scaler, extra=extra)


def train_step(state, batch):
    model, opt = state.model, state.optimizer
    if isinstance(opt, torch.optim.LBFGS):
        def closure():
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
            loss.backward()
            return loss
        loss = opt.step(closure)
    elif state.scaler is not None:
        loss = nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
        # grad_mult = inf simulates fp16 gradient overflow while the loss itself stays finite.
        state.scaler.scale(loss * batch.get("grad_mult", 1.0)).backward()
        state.scaler.step(opt)
        state.scaler.update()
        opt.zero_grad(set_to_none=True)
    else:
        loss = nn.functional.mse_loss(model(batch["x"]).squeeze(-1), batch["y"])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if state.scheduler is not None:
        state.scheduler.step()
    return loss


def sqrt_step(state, batch):
    """Loss stays finite while the gradient goes NaN: d/du sqrt(u) at u = 0 is inf."""
    out = state.model(batch["x"]).squeeze(-1)
    loss = nn.functional.mse_loss(out, batch["y"])
    if bool((batch["x"][:, 0] == 0).all()):
        loss = loss + 1e-3 * torch.sqrt(((out - out.detach()) ** 2).sum())
    loss.backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    return loss


def corrupting_step(state, batch):
    """A step with a bug that writes inf into a weight when the batch says so."""
    loss = train_step(state, batch)
    if bool(batch["corrupt"]):
        with torch.no_grad():
            state.model[0].weight[0, 0] = float("inf")
    return loss


def batches(config, steps, poison_step=None, spike_step=None, zero_step=None, corrupt_step=None):
    g = torch.Generator().manual_seed(config.get("seed", 0) + 100)
    d, bs = config.get("dim", 8), config.get("batch_size", 16)
    w = torch.randn(d, generator=g)
    for s in range(steps):
        x = torch.randn(bs, d, generator=g)
        y = x @ w
        if s == poison_step:
            x[3, 1] = float("nan")
        if s == spike_step:
            y = y * 1e4
        if s == zero_step:
            x[:, 0] = 0.0
        batch = {"x": x, "y": y, "index": torch.arange(s * bs, (s + 1) * bs)}
        if corrupt_step is not None:
            batch["corrupt"] = s == corrupt_step
        yield batch


def loss_above(step, loss, state):
    """A user predicate: fail once the loss passes 1e3."""
    return loss is not None and loss > 1e3 and f"loss {loss:.1f} above 1e3"


@lagged
def loss_above_lagged(step, loss, state):
    """``loss_above``, marked lagged: it reads the loss only, so it may be judged steps after its step."""
    return loss_above(step, loss, state)


def counting_step(state, batch):
    """``train_step`` that counts its calls in ``state.extra`` (build with ``{"count": True}``)."""
    loss = train_step(state, batch)
    state.extra["calls"] += 1
    return loss


def seven_calls(step, loss, state):
    """A predicate that reads the state its step left: fires once the step function has run seven times."""
    return state.extra["calls"] >= 7 and f"{state.extra['calls']} calls"


def scribbling_step(state, batch):
    """A step that overwrites its input batch in place after using it."""
    loss = train_step(state, batch)
    batch["x"].mul_(0)
    return loss
