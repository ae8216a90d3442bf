"""Record a Lightning ``Trainer`` run; replay its steps through Lightning's own optimization loops.

Usage (nothing else changes in the script)::

    from reprokit.integrations.lightning import ReprokitCallback
    trainer = lightning.pytorch.Trainer(callbacks=[ReprokitCallback(out_dir="repros")])
    trainer.fit(model, loader)

Design. A reprokit step is one pass of Lightning's per-batch optimization: ``_AutomaticOptimization.run``
(the closure with ``zero_grad`` on the first batch of an accumulation, ``training_step``, the loss divided by
``accumulate_grad_batches``, ``backward`` through the precision plugin, and, when the batch ends an
accumulation, ``optimizer_step`` with ``on_before_optimizer_step`` and gradient clipping), or
``_ManualOptimization.run`` (``training_step`` calling ``manual_backward`` and ``opt.step()`` itself),
followed by the ``interval="step"`` LR schedulers Lightning steps after it.

* Recording: at ``on_train_start`` the callback puts a :class:`reprokit.Recorder` around those two ``run``
  methods of the live trainer, so each batch runs between ``Recorder.begin_step`` and ``Recorder.end_step``
  exactly as Lightning runs it (batch, RNG and state are taken at its start; an exception or a non-finite loss
  writes a bundle and is raised through Lightning, which calls ``on_exception`` and stops). The recorded batch is
  ``{"batch": BATCH, "lightning": {"batch_idx", "optimizer_step"}}``: whether this batch ended an
  accumulation (and, on an epoch's last batch, ``epoch_end`` and ``epoch``) is recorded, not recomputed.
* Replay: ``build(config)`` imports the LightningModule class from the bundle's code snapshot (vetted like
  every ref), constructs it from its ``save_hyperparameters()`` values (JSON in run.json, never a pickle),
  and connects it to a headless ``Trainer`` made with the recorded precision, clipping and accumulation
  settings; ``configure_optimizers`` gives the optimizer and scheduler configs. :func:`train_step` then calls
  the same ``run`` method of that trainer's loop, and steps the ``interval="step"`` schedulers as
  ``TrainingEpochLoop._update_learning_rates`` does. Losses replay bit-exact on CPU.

Skipping (``on_failure="skip"``, see :mod:`reprokit.skip`): a detector's failure (never an exception) is replayed
on the live trainer through the same automatic optimization ``run`` (:meth:`ReprokitCallback._replay_live`), each
replayed batch before the failing one followed by its schedulers as Lightning stepped them. Lightning's counters: the
automatic optimization's progress (``global_step``, the ``zero_grad`` counts) is put back when the attempt ends, so
the failing batch counts once; batch, epoch and ``_batches_that_stepped`` progress are never moved by a replay; the
failing batch's own schedulers are not stepped by any replay: Lightning steps them (and counts them) after the batch
as for every batch, from the state the last replay (the batch without the culprit rows) left. What cannot be undone
is refused at ``on_fit_start``, before the first batch (:func:`_refuse_what_skip_cannot_do`).

Several ranks (``strategy="ddp"`` under torchrun): every rank records through the multi-rank machinery (one
incident folder, every rank's window; see :mod:`reprokit.distributed`). A rank's bundle replays alone on one
device (no all-reduce, so not bit-exact); ``reprokit replay INCIDENT --nproc N`` rebuilds each rank's module
behind Lightning's DDP strategy in the process group replay starts, and replays bit-exact on CPU.

Limits (said at attach time when they apply): one optimizer and at most one LR scheduler; ``self.log`` calls
are no-ops on replay (logging does not change training); hooks that run outside the optimization
(``on_train_batch_start/end``, callbacks changing weights, an EMA) are not part of the replayed step;
``ReduceLROnPlateau`` steps on a metric between batches, which replay cannot recompute: with one, the batch after
an epoch end or a validation starts a new window (a fresh snapshot), so no window runs over its step. An ``interval="epoch"``
scheduler (the default of ``return [opt], [sched]``) steps after an epoch's last batch: that batch is
recorded with ``epoch_end`` and its epoch, and replay steps the scheduler there as Lightning does.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections import OrderedDict
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from reprokit.code import ref_of, resolve_project
from reprokit.detect import current_step
from reprokit.distributed import world_size
from reprokit.errors import CaptureError, CodeLoadError, ConfigError
from reprokit.record import Recorder
from reprokit.skip import GUIDE, SkipSettings, as_indices
from reprokit.state import TrainState

BATCH = "batch"
META = "lightning"
TRAINER_FLAGS = ("accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm", "precision")
"""The Trainer settings that change what one optimization step computes, recorded in run.json."""
IN_STEP_HOOKS = ("on_before_zero_grad", "on_before_backward", "on_after_backward", "on_before_optimizer_step")
"""The callback hooks Lightning calls inside a batch's optimization: a skip's replays would call them again."""
SKIP_OPTIONS = ("on_failure", "skip_budget_s", "max_skips", "skip_window")

__all__ = ["ReprokitCallback", "build", "train_step"]


class ReprokitCallback(Callback):
    """A Lightning callback that records the run and writes a bundle when it fails.

    Args:
        out_dir: where bundles are written.
        **recorder_options: passed to :class:`reprokit.Recorder` (``snapshot_every``, ``check_grads``,
            ``detect``, ``host_memory_budget``, ``on_incident``, ``on_failure``...).

    With ``on_failure="skip"``, a detector's failure (a non-finite loss or gradient norm) whose cause is proven to be
    rows of the batch is skipped: the batch is replayed on the live Trainer without those rows and training goes on
    (see :mod:`reprokit.skip`). An exception inside a batch is never skipped. Manual optimization, gradient
    accumulation, several optimizers or processes, and callbacks with hooks inside the optimization are refused with
    :class:`reprokit.ConfigError` at ``on_fit_start``, before the first batch.

    Example:
        >>> trainer = pl.Trainer(callbacks=[ReprokitCallback(out_dir="repros")])   # doctest: +SKIP
        >>> trainer.fit(model, loader)                                            # doctest: +SKIP
    """

    def __init__(self, out_dir: str = "repros", **recorder_options: Any):
        for key in ("build", "config", "state", "train_step"):
            if key in recorder_options:
                raise CaptureError(f"ReprokitCallback({key}=...): the callback makes {key} itself from the "
                                   "LightningModule and the Trainer; drop it")
        # The on_failure options are checked here, as the Recorder checks them; what the Trainer and the module allow
        # under on_failure="skip" is checked at on_fit_start, before the first batch (see _refuse_what_skip_cannot_do).
        SkipSettings(**{k: recorder_options[k] for k in SKIP_OPTIONS if k in recorder_options},
                     skip_indices=as_indices(recorder_options.get("skip_indices")))
        if recorder_options.get("on_failure") == "skip" and recorder_options.get("max_lag"):
            raise ConfigError.option("max_lag", f"{{opt}}={recorder_options['max_lag']} with on_failure=\"skip\": a "
                                                "skip rolls the run back to the failing step, so every step is judged "
                                                "at its own end (leave {opt} out, or pass 0)")
        self.out_dir = out_dir
        self.options = recorder_options
        self.recorder: Recorder | None = None
        self._output: Any = None
        self._restore: tuple[Any, ...] = ()
        self._lrs_at_validation: list[float] | None = None
        self._trainer: pl.Trainer | None = None
        self._auto_run: Any = None
        """The automatic optimization's own ``run`` (not the recording wrapper): what a skip's replays call."""
        self._failing: int | None = None
        """The step being run (the one a skip attempt would roll back to)."""
        self._replays: dict[str, Any] | None = None
        """While a skip attempt replays: what :meth:`_leave_replays` puts back (Lightning's progress counters, the
        module's ``log``)."""

    @property
    def skips(self) -> bool:
        return self.options.get("on_failure", "raise") == "skip"

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.skips:
            _refuse_what_skip_cannot_do(trainer, pl_module, self)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state, config = _describe(trainer, pl_module)
        try:
            # build and step are reprokit's: the code snapshot is the LightningModule's project (carry).
            carry = (type(pl_module), *self.options.get("carry", ()))
            rec = Recorder(state, train_step, build=build, config=config, out_dir=self.out_dir,
                           **{**self.options, "carry": carry})
        except CaptureError as e:
            if "config/hparams/" not in str(e):
                raise
            raise CaptureError(f"{e}. Replay rebuilds {type(pl_module).__qualname__} from its saved hyperparameters, "
                               "kept as JSON in the bundle: take plain values in __init__ (a config dataclass as "
                               "its fields, or a dict), or leave the others out with save_hyperparameters(ignore=[...]) "
                               "and give them defaults") from None
        # Replay runs reprokit's train_step on a headless trainer. While recording, the callback runs Lightning's
        # step itself between begin_step and end_step; the Recorder calls its step function only to replay the
        # window on the live trainer when on_failure="skip" tries a skip (_replay_live).
        rec.train_step = self._replay_live
        self._trainer = trainer
        # Steps are the fit's batches: a fit resumed from a checkpoint (ckpt_path=) counts on from its batches.
        rec.step_index = int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)
        self.recorder = rec
        loop = trainer.fit_loop.epoch_loop
        auto, manual = loop.automatic_optimization, loop.manual_optimization
        auto_run, manual_run = auto.run, manual.run

        def recorded_auto(optimizer: Any, batch_idx: int, kwargs: OrderedDict) -> Any:
            return self._step(trainer, auto_run, (optimizer, batch_idx, kwargs), kwargs, batch_idx)

        def recorded_manual(kwargs: OrderedDict) -> Any:
            return self._step(trainer, manual_run, (kwargs,), kwargs, int(kwargs.get("batch_idx", 0)))

        self._auto_run = auto_run
        auto.run = recorded_auto  # type: ignore[method-assign]
        manual.run = recorded_manual  # type: ignore[method-assign]
        self._restore = (auto, manual)

    def _step(self, trainer: pl.Trainer, run: Any, args: tuple[Any, ...], kwargs: OrderedDict, batch_idx: int) -> Any:
        assert self.recorder is not None
        loop = trainer.fit_loop
        steps = not loop._should_accumulate()
        meta = {"batch_idx": batch_idx, "optimizer_step": steps}
        if loop.epoch_loop._num_ready_batches_reached():  # Lightning steps interval="epoch" schedulers after it
            meta.update(epoch_end=True, epoch=int(trainer.current_epoch))
        if self._lrs_at_validation is not None:
            if _lrs(trainer) != self._lrs_at_validation:
                self.recorder.request_snapshot()
            self._lrs_at_validation = None
        rec = self.recorder
        self._output = None
        self._failing = rec.step_index
        # skip_indices (a skipping run's reprokit.skip_list): their rows leave the batch Lightning trains on too.
        batch = rec.without_skipped({BATCH: kwargs[BATCH], META: meta})
        kwargs[BATCH] = batch[BATCH]
        rec.begin_step(batch)
        try:
            self._output = run(*args)
        except Exception as e:
            # Written to a bundle and raised through Lightning; never skipped (skip.CAUGHT_BY_THE_CALLER): an
            # exception leaves Lightning's step half done (its counters, the closure), which no replay can mend.
            self._end(rec, None, e)
            raise
        # A failure the Recorder skips replays the window on this trainer (_replay_live): its last replay, the batch
        # without the culprit rows, leaves the state the run goes on with, and its output in self._output.
        self._end(rec, _loss_of(self._output), None)
        if meta.get("epoch_end") and any(cfg.reduce_on_plateau for cfg in trainer.lr_scheduler_configs):
            # ReduceLROnPlateau steps on a metric after this batch, which replay cannot recompute: the next
            # batch starts a window of its own (a snapshot holds the scheduler as the metric left it).
            self.recorder.request_snapshot()
        return self._output

    def _end(self, rec: Recorder, loss: Any, exc: BaseException | None) -> None:
        try:
            rec.end_step(loss, exc=exc)
        finally:
            self._leave_replays()

    def _replay_live(self, state: TrainState, batch: dict[str, Any]) -> Any:
        """One recorded batch through the live trainer's optimization, for a skip attempt's replays (see
        :mod:`reprokit.skip`): :func:`train_step` on the running Trainer.

        Lightning's own loop is not moved: the automatic optimization's progress counters (``global_step``) are
        put back when the attempt ends, ``self.log`` logs nothing while it replays, and the failing step's schedulers
        are not stepped here: once the Recorder returns, Lightning steps them after the batch, as for every batch,
        from the state the batch without the culprit rows left."""
        trainer = self._trainer
        assert trainer is not None and self._auto_run is not None
        module: Any = trainer.lightning_module
        if self._replays is None:
            self._replays = {"progress": trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.state_dict(),
                             "log": {k: module.__dict__[k] for k in ("log", "log_dict") if k in module.__dict__}}
            module.log = module.log_dict = _no_log
        meta = batch[META]
        idx = int(meta["batch_idx"])
        output = self._auto_run(trainer.optimizers[0], idx, OrderedDict([(BATCH, batch[BATCH]), ("batch_idx", idx)]))
        self._output = output
        running = current_step()
        if running is None or running[0] != self._failing:  # a window step before the failing one: as Lightning did
            if meta["optimizer_step"]:
                _step_schedulers(trainer, "step", idx + 1)
            if meta.get("epoch_end"):
                _step_schedulers(trainer, "epoch", int(meta["epoch"]) + 1)
        loss = _loss_of(output)
        return loss if isinstance(loss, torch.Tensor) else None

    def _leave_replays(self) -> None:
        saved, self._replays = self._replays, None
        if saved is None or self._trainer is None:
            return
        module: Any = self._trainer.lightning_module
        self._trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.load_state_dict(saved["progress"])
        for name in ("log", "log_dict"):
            module.__dict__.pop(name, None)
        module.__dict__.update(saved["log"])

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning steps a ReduceLROnPlateau on the metrics right after a validation, between training batches
        # (val_check_interval) or at an epoch end: the next batch starts a window of its own, as in _step.
        if self.recorder is not None and any(cfg.reduce_on_plateau for cfg in trainer.lr_scheduler_configs):
            self._lrs_at_validation = _lrs(trainer)  # _step compares: only a cut needs a new window

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._detach()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._detach()

    def _detach(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        for loop in getattr(self, "_restore", ()):
            loop.__dict__.pop("run", None)  # the class's run again
        self._restore = ()


def _refuse_what_skip_cannot_do(trainer: pl.Trainer, module: pl.LightningModule, me: Callback) -> None:
    """``on_failure="skip"`` replays a failing batch's window on the live trainer, several times, and goes on from the
    last replay: refused, before the first batch, where that cannot leave the run as one whose data never held the
    culprit rows."""
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    why = []
    callbacks: list[Any] = list(getattr(trainer, "callbacks", []))
    if not module.automatic_optimization:
        why.append("manual optimization (automatic_optimization = False): training_step steps the optimizer and its "
                   "schedulers itself, and Lightning's counters of those steps cannot be told from a replay's")
    if len(trainer.optimizers) != 1:
        why.append(f"{len(trainer.optimizers)} optimizers: the callback records one")
    if trainer.accumulate_grad_batches != 1 or any(isinstance(c, GradientAccumulationScheduler)
                                                   for c in callbacks):
        why.append(f"gradient accumulation (accumulate_grad_batches={trainer.accumulate_grad_batches}, or a "
                   "GradientAccumulationScheduler): Lightning decides from its live batch counters whether a batch "
                   "steps the optimizer, so a replay of an earlier batch of the window would step where the recorded "
                   "one accumulated")
    if trainer.strategy.handles_gradient_accumulation:
        why.append(f"the {type(trainer.strategy).__name__} strategy, which steps the optimizer itself")
    if trainer.world_size > 1:
        why.append(f"{trainer.world_size} processes (strategy={type(trainer.strategy).__name__}): a skip through the "
                   "Lightning callback is for one process (use reprokit.Recorder under torchrun to skip on several "
                   "ranks)")
    hooked = sorted({f"{type(c).__qualname__}.{h}" for c in callbacks if c is not me for h in IN_STEP_HOOKS
                     if getattr(type(c), h, None) is not getattr(Callback, h)})
    if hooked:
        why.append(f"callback hooks that run inside the batch's optimization ({', '.join(hooked)}): the replays of a "
                   "skip would call them again, or, without them, replay another run than the recorded one")
    if why:
        raise ConfigError.option("on_failure", f"{{opt}}=\"skip\" through the Lightning callback cannot skip in this "
                                               f"run: {'; '.join(why)}. Record with {{opt}}=\"raise\" (the default), "
                                               f"or change the run (see {GUIDE})")


def _describe(trainer: pl.Trainer, module: pl.LightningModule) -> tuple[TrainState, dict[str, Any]]:
    """The TrainState and the config ``build`` takes (whose ``module`` is the class's ref)."""
    if len(trainer.optimizers) != 1 or len(trainer.lr_scheduler_configs) > 1:
        raise CaptureError(f"reprokit's Lightning callback records one optimizer and at most one LR scheduler; "
                           f"configure_optimizers gave {len(trainer.optimizers)} optimizer(s) and "
                           f"{len(trainer.lr_scheduler_configs)} scheduler(s), which replay could not rebuild. Return one "
                           "optimizer (and one scheduler) from configure_optimizers, or train this module without "
                           "ReprokitCallback")
    cls = type(module)
    try:
        cls_ref, root = ref_of(cls, "the LightningModule class")
    except CaptureError as e:
        raise CaptureError(f"{e}; reprokit rebuilds the module on replay by importing its class") from None
    if root is None:
        raise CaptureError(f"{cls.__module__}.{cls.__qualname__} is installed code, not the project's; reprokit "
                           "replays the project's own LightningModule subclass (define one in your project)")
    hparams = dict(module.hparams)
    try:
        inspect.signature(cls).bind(**hparams)
    except TypeError as e:
        raise CaptureError(f"{cls.__qualname__}(**hparams) cannot be called with its saved hyperparameters "
                           f"({sorted(hparams)}): {e}. Call self.save_hyperparameters() in __init__ so that replay "
                           "can rebuild the module") from None
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    sched = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
    state = TrainState(model=module, optimizer=trainer.optimizers[0], scheduler=sched, scaler=scaler)
    config = {"module": cls_ref, "hparams": hparams,
              "trainer": {k: getattr(trainer, k) for k in TRAINER_FLAGS},
              "automatic_optimization": module.automatic_optimization,
              "accelerator": "gpu" if module.device.type == "cuda" else "cpu"}
    return state, config


def _lrs(trainer: pl.Trainer) -> list[float]:
    return [float(group["lr"]) for opt in trainer.optimizers for group in opt.param_groups]


def _loss_of(output: Any) -> Any:
    return output.get("loss") if isinstance(output, dict) else output


def _no_log(*args: Any, **kwargs: Any) -> None:
    """``self.log`` on replay: logging does not change training, and there is no logger connector."""


def build(config: dict[str, Any]) -> TrainState:
    """Rebuild the recorded LightningModule on a headless Trainer (what replay calls; see the module docstring).

    Raises:
        CodeLoadError: the class is not a LightningModule, or constructing it failed.
    """
    cls = resolve_project(config["module"], "module")
    if not (isinstance(cls, type) and issubclass(cls, pl.LightningModule)):
        raise CodeLoadError(f"config.module names {cls!r}, not a LightningModule subclass")
    module = cls(**config["hparams"])
    flags = {k: config["trainer"][k] for k in TRAINER_FLAGS if k in config["trainer"]}  # nothing else reaches Trainer
    # Replay runs where the bundle was recorded when it can (reprokit's default device), else on the CPU.
    accelerator = "gpu" if config.get("accelerator") == "gpu" and torch.cuda.is_available() else "cpu"
    ranks = world_size()
    if ranks > 1:
        flags["strategy"] = "ddp"
    quiet = logging.getLogger("lightning.pytorch")  # "GPU available: ..." lines are about this headless trainer
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        devices = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if ranks > 1 else 1
        trainer = pl.Trainer(accelerator=accelerator, devices=devices, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, **flags)
    finally:
        quiet.setLevel(level)
    trainer.state.fn, trainer.state.stage = TrainerFn.FITTING, RunningStage.TRAINING
    trainer.strategy.connect(module)
    module.trainer = trainer
    if ranks > 1:  # an incident replayed on its N ranks: the model behind DDP, as the recorded run had it
        trainer.strategy.setup_environment()
        trainer.strategy.model = trainer.strategy._setup_model(module)
    module.log = module.log_dict = _no_log  # type: ignore[method-assign]
    optimizers, schedulers = _init_optimizers_and_lr_schedulers(module)
    trainer.strategy.optimizers = optimizers
    trainer.strategy.lr_scheduler_configs = schedulers
    if module.automatic_optimization != config["automatic_optimization"]:
        raise CodeLoadError(f"{cls.__qualname__}.automatic_optimization is {module.automatic_optimization} now, "
                            f"{config['automatic_optimization']} when recorded")
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return TrainState(model=module, optimizer=optimizers[0], scheduler=schedulers[0].scheduler if schedulers else None,
                      scaler=scaler)


def train_step(state: TrainState, batch: dict[str, Any]) -> Any:
    """One recorded batch through the headless trainer's own optimization loop, then its per-step schedulers."""
    module: Any = state.model
    trainer: Any = module.trainer
    meta = batch[META]
    idx, steps = int(meta["batch_idx"]), bool(meta["optimizer_step"])
    trainer.fit_loop._should_accumulate = lambda: not steps  # type: ignore[method-assign]
    loop = trainer.fit_loop.epoch_loop
    kwargs = OrderedDict([(BATCH, batch[BATCH]), ("batch_idx", idx)])
    if module.automatic_optimization:
        output = loop.automatic_optimization.run(trainer.optimizers[0], idx, kwargs)
        if steps:  # TrainingEpochLoop.update_lr_schedulers("step", update_plateau_schedulers=False)
            _step_schedulers(trainer, "step", idx + 1)
        if meta.get("epoch_end"):  # the epoch's last batch: then the "epoch" ones (update_lr_schedulers("epoch"))
            _step_schedulers(trainer, "epoch", int(meta["epoch"]) + 1)
    else:
        output = loop.manual_optimization.run(kwargs)
    loss = _loss_of(output)
    return loss if isinstance(loss, torch.Tensor) else None


def _step_schedulers(trainer: Any, interval: str, index: int) -> None:
    """Step the non-plateau schedulers of ``interval`` as ``TrainingEpochLoop._update_learning_rates`` does
    (``index`` counts from 1: the batch in the epoch for "step", the epoch for "epoch")."""
    for cfg in trainer.lr_scheduler_configs:
        if cfg.interval == interval and not cfg.reduce_on_plateau and index % cfg.frequency == 0:
            call._call_lightning_module_hook(trainer, "lr_scheduler_step", cfg.scheduler, None)
