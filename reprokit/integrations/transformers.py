"""Record a Hugging Face ``Trainer`` run: one callback, nothing else in the script changes.

Example:
    >>> from reprokit.integrations.transformers import ReprokitCallback        # doctest: +SKIP
    >>> trainer = Trainer(model=model, args=args, train_dataset=ds,            # doctest: +SKIP
    ...                   callbacks=[ReprokitCallback(out_dir="repros")])
    >>> trainer.train()                                                        # doctest: +SKIP

One recorded step is one optimizer update of the Trainer: its micro-batches (as the Trainer feeds
them to ``training_step``, after collation), their forward and backward, gradient clipping, the
optimizer step (GradScaler included), the LR scheduler step and ``zero_grad``. The bundle's
``build`` and step function live here (:func:`build`, :func:`train_step`): replay makes a real
``Trainer`` of the recorded class from the recorded ``TrainingArguments`` and model config (JSON,
never a pickle), prepares it with the Trainer's own ``_prepare_for_training`` (accelerate,
optimizer, scheduler), and runs the update with the Trainer's own ``training_step``,
``_clip_grad_norm``, optimizer and scheduler. The user writes no ``build``; a model or Trainer
class of the user's own project is imported from the bundle's code snapshot.

How it hooks in (all from the callback, on the Trainer instance only): ``get_batch_samples``
(to see each update's micro-batches), ``training_step`` (to sum the update's loss) and
``_run_epoch`` (so that an exception anywhere in an update writes a bundle before it propagates)
are wrapped; the train dataloader's batch sampler is wrapped to learn each micro-batch's dataset
indices (kept in the bundle beside the batch, so ``reprokit shrink`` reports the offending sample's
index). The grad check reads the gradients in a pre-hook of the (unwrapped) optimizer, as for a
hand-written loop.
"""

from __future__ import annotations

import importlib
import inspect
import json
import shutil
import tempfile
import weakref
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import PretrainedConfig, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import IntervalStrategy

from reprokit.code import ref_label, ref_of, resolve_project
from reprokit.errors import BundleError, CaptureError, CodeLoadError, StateMismatchError
from reprokit.record import Recorder
from reprokit.state import TrainState

__all__ = ["ReprokitCallback", "build", "train_step"]

MICRO = "micro"
"""Batch key: the update's micro-batches, each ``{"inputs": {...}, "index": LongTensor[rows]}``."""
NUM_ITEMS = "num_items_in_batch"
"""Batch key, multi-process recordings only: the token count the Trainer gathered over every rank."""
N_GPU = "n_gpu"
"""Config key: the recorded Trainer's ``args.n_gpu`` (more than 1: ``DataParallel`` over that many GPUs)."""


@dataclass(kw_only=True)
class HFTrainState(TrainState):
    """A :class:`TrainState` that also holds the ``Trainer`` whose step replay runs (never snapshotted)."""

    trainer: Any = None


def _unwrap(obj: Any, attr: str) -> Any:
    """accelerate's ``AcceleratedOptimizer`` / ``AcceleratedScheduler`` hold the torch object under ``attr``."""
    inner = getattr(obj, attr, None)
    return inner if inner is not None and type(obj).__module__.startswith("accelerate") else obj


def _state_of(trainer: Any) -> HFTrainState:
    scaler = getattr(trainer.accelerator, "scaler", None)
    return HFTrainState(model=trainer.model, optimizer=_unwrap(trainer.optimizer, "optimizer"),
                        scheduler=_unwrap(trainer.lr_scheduler, "scheduler"), scaler=scaler, trainer=trainer)


# --- replay: build and step ---------------------------------------------------------------

def build(config: dict[str, Any]) -> HFTrainState:
    """A Trainer as the recorded one was at train start: model from its config, args, optimizer, scheduler.

    ``config`` is what :class:`ReprokitCallback` recorded: ``trainer`` / ``model`` class refs, the
    model's config dict and dtype, ``args`` (``TrainingArguments`` fields), ``max_steps`` and ``n_gpu``.

    Raises:
        StateMismatchError: this process's Trainer would run on another number of GPUs than the
            recorded one, with ``DataParallel`` on either side (see :func:`_check_gpu_count`).
    """
    model_cls = _import_class(config["model"]["class"], "model", torch.nn.Module)
    trainer_cls = _import_class(config["trainer"]["class"], "trainer", Trainer)
    config_cls = _import_class(config["model"]["config_class"], "model config", PretrainedConfig)
    model_config = config_cls.from_dict(dict(config["model"]["config"]))
    dtype = getattr(torch, str(config["model"]["dtype"]), None)
    if not isinstance(dtype, torch.dtype):  # the bundle names it: a torch dtype, never another attribute of torch
        raise BundleError(f"run.json: config.model.dtype = {config['model']['dtype']!r} is not a torch dtype; the "
                          "bundle is invalid. Record it again, or get it again from whoever made it.",
                          [{"file": "run.json", "problem": "config.model.dtype is not a torch dtype"}])
    model = model_cls(model_config).to(dtype)
    scratch = tempfile.mkdtemp(prefix="reprokit-trainer-")  # the Trainer makes its output_dir; replay writes nothing
    try:
        replay_args = {**_args_for_replay(config["args"]), "output_dir": scratch}
        if config.get(N_GPU) and not torch.cuda.is_available():
            # Recorded on a GPU, replayed where torch sees none (a CPU machine, or the CPU part of a device error's
            # triage, which hides the GPUs): the Trainer must be told, or bf16 / fp16 arguments refuse the CPU.
            replay_args["use_cpu"] = True
        args = TrainingArguments(**replay_args)
        # Replay never evaluates; set after the arguments' own checks, which want an eval strategy for a scheduler
        # that steps on eval metrics (reduce_lr_on_plateau), and before the Trainer's, which want an eval_dataset.
        args.eval_strategy = IntervalStrategy.NO
        _check_gpu_count(config.get(N_GPU), args.n_gpu)
        trainer = trainer_cls(model=model, args=args)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _attach_train_hooks(trainer)
    trainer._prepare_for_training(int(config["max_steps"]), None, None)
    return _state_of(trainer)


def _attach_train_hooks(trainer: Any) -> None:
    """What ``Trainer.train`` attaches to the model before preparing it and that changes what a step computes:
    NEFTune's embedding noise (``neftune_noise_alpha``; drawn from the recorded RNG). Replay never calls ``train``."""
    if getattr(trainer, "neftune_noise_alpha", None) is not None:
        neftune = importlib.import_module("transformers.integrations.neftune")
        trainer.neftune_hook_handle = neftune.activate_neftune(trainer.model, trainer.neftune_noise_alpha,
                                                               trainer.accelerator)


def _check_gpu_count(recorded: Any, here: int) -> None:
    """Refuse a replay whose Trainer would see another number of GPUs than the recorded one did.

    A Trainer that is not launched distributed uses every GPU its process sees (``args.n_gpu``);
    with more than one it wraps the model in ``DataParallel``, which splits each micro-batch over
    them and averages their losses: another update than the recorded one. A bundle of an older
    reprokit does not say its count (``recorded`` is None): replayed as before, unless this
    Trainer would use ``DataParallel``.
    """
    if recorded is not None and (type(recorded) is not int or recorded < 0):
        raise StateMismatchError(f"run.json's config.{N_GPU} is {recorded!r}, expected the number of GPUs the "
                                 "recorded Trainer used (an int >= 0); the bundle was edited or is damaged")
    if recorded == here or max(recorded or 0, here) <= 1:
        return
    why = ("a Trainer that is not launched distributed runs on every GPU its process sees, through DataParallel "
           "when they are several (each batch split over them, the loss averaged): another update than the "
           "recorded one")
    if recorded is None:
        raise StateMismatchError(
            f"this bundle does not say on how many GPUs its Trainer ran (an older reprokit wrote it), and the "
            f"Trainer here would run on {_gpus(here)}; {why}. Show the replay as many GPUs as the recording had "
            "(env.json lists its devices), e.g. one: `CUDA_VISIBLE_DEVICES=0 reprokit replay BUNDLE` (the same for "
            "shrink, bisect and extract)")
    if recorded > here:
        todo = (f"replay on a machine with at least {recorded} GPUs, with CUDA_VISIBLE_DEVICES naming "
                f"{recorded} of them")
    else:
        ids = ",".join(map(str, range(recorded))) or '""'
        todo = (f"show the replay {'no GPU' if recorded == 0 else _gpus(recorded)}: "
                f"`CUDA_VISIBLE_DEVICES={ids} reprokit replay BUNDLE` (the same for shrink, bisect and extract)")
    raise StateMismatchError(f"the bundle was recorded by a Trainer that ran on {_gpus(recorded)}, but the "
                             f"Trainer here would run on {_gpus(here)}; {why}. To replay it as recorded, {todo}")


def _gpus(n: int) -> str:
    return {0: "no GPU (the CPU)", 1: "one GPU"}.get(n, f"{n} GPUs (DataParallel)")


def train_step(state: TrainState, batch: dict[str, Any]) -> torch.Tensor:
    """One optimizer update as ``Trainer._run_epoch`` runs it; returns the sum of its micro-batch losses."""
    trainer = state.trainer  # type: ignore[attr-defined]
    micro = [m["inputs"] for m in batch[MICRO]]
    if NUM_ITEMS in batch:
        num_items = batch[NUM_ITEMS]
    else:
        num_items = trainer._get_num_items_in_batch(micro, trainer.args.device)
    trainer.current_gradient_accumulation_steps = len(micro)
    model = trainer.model_wrapped
    total = None
    for i, inputs in enumerate(micro):
        trainer.accelerator.gradient_state._set_sync_gradients(i == len(micro) - 1)
        loss = trainer.training_step(model, inputs, num_items)
        total = loss if total is None else total + loss
    grad_norm = trainer._clip_grad_norm(model) if trainer.args.max_grad_norm > 0 else None
    trainer._get_grad_norm(model, grad_norm=grad_norm)  # without clipping it still unscales fp16 gradients
    trainer.optimizer.step()
    if not trainer.accelerator.optimizer_step_was_skipped and not isinstance(trainer.lr_scheduler, _METRIC_SCHEDULERS):
        trainer.lr_scheduler.step()
    model.zero_grad()
    assert total is not None, "an update without micro-batches"
    return total


_GREEDY = getattr(importlib.import_module("transformers.optimization"), "GreedyLR", None)
_METRIC_SCHEDULERS: tuple[type, ...] = (torch.optim.lr_scheduler.ReduceLROnPlateau,) + ((_GREEDY,) if _GREEDY else ())
"""Schedulers the Trainer steps on evaluation metrics, not after each update."""


def _import_class(ref: dict[str, Any], what: str, base: type) -> Any:
    """The class a recorded ref names: one of transformers', or one of the project's (vetted and imported by
    :func:`reprokit.code.resolve_project` from the code being replayed); only a subclass of ``base``."""
    module = str(ref.get("module", "")) if isinstance(ref, dict) else ""
    if module.split(".")[0] == "transformers" and all(p.isidentifier() for p in module.split(".")):
        try:
            obj: Any = importlib.import_module(module)
            for part in str(ref["qualname"]).split("."):
                obj = getattr(obj, part)
        except Exception as e:
            raise CodeLoadError(f"cannot import the recorded {what} class {module}:{ref.get('qualname')}: "
                                f"{type(e).__name__}: {e}") from None
    else:
        obj = resolve_project(ref, f"{what}.class")
    if not (isinstance(obj, type) and issubclass(obj, base)):
        raise CodeLoadError(f"the bundle's {what} class {ref_label(ref)} is not a subclass of {base.__qualname__}; "
                            "replay instantiates only those")
    return obj


_NOT_REPLAYED: dict[str, Any] = {"output_dir": None, "report_to": [], "push_to_hub": False, "hub_token": None,
                 "logging_dir": None, "save_strategy": "no", "load_best_model_at_end": False,
                 "dataloader_num_workers": 0}
"""Arguments that decide where a run writes or reports, never what a step computes: replay writes nowhere."""


def _args_for_replay(recorded: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in TrainingArguments.__dataclass_fields__.values() if f.init}
    out = {k: v for k, v in recorded.items() if k in names and not k.startswith("_")}
    out.update({k: v for k, v in _NOT_REPLAYED.items() if k in names})
    return out


def _args_to_record(args: TrainingArguments) -> dict[str, Any]:
    """The ``TrainingArguments`` fields, as JSON-able values (credentials, ``hub_token``, left out).

    Only secrets are left out by name: ``average_tokens_across_devices`` changes the loss scaling of a
    multi-process run. Nested lists and dicts (``lr_scheduler_kwargs``) are kept as JSON.
    """
    out: dict[str, Any] = {}
    for k, v in args.to_dict().items():
        if k.endswith("token"):
            continue
        try:
            out[k] = json.loads(json.dumps(v, allow_nan=False))
        except (TypeError, ValueError):
            pass  # anything else (callables, objects) stays at its default on replay
    return out


_HOOKED = ("get_batch_samples", "training_step", "_run_epoch", "_prepare_for_training", "_get_num_items_in_batch",
           "_clip_grad_norm", "_get_grad_norm")
"""Trainer methods the callback wraps (the first three) or replay calls."""


# --- recording ----------------------------------------------------------------------------

class _IndexedBatches:
    """Stands in for a DataLoader's batch sampler: yields what it yields and queues each batch's indices."""

    def __init__(self, inner: Any, queue: deque[list[int]]):
        self._inner = inner
        self._queue = queue

    def __iter__(self) -> Iterator[Any]:
        for indices in self._inner:
            self._queue.append(list(indices) if isinstance(indices, (list, tuple)) else [])
            yield indices

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class ReprokitCallback(TrainerCallback):
    """Record a ``Trainer`` run and write a replayable bundle when it fails.

    Args:
        out_dir: where bundles are written.
        **recorder_options: any keyword of :class:`reprokit.Recorder` except ``build``/``config``
            (``snapshot_every``, ``check_grads``, ``spike_factor``, ``host_memory_budget``, ``on_incident``...).

    A failure (an exception in an update, a non-finite loss or gradient norm, a detector) writes a
    bundle and stops training: the exception propagates out of ``trainer.train()`` with the bundle
    path as a note, or :class:`reprokit.TrainingFailure` is raised (``.bundle``). Steps are
    optimizer updates (``state.global_step`` counts the same way).

    With ``on_failure="skip"``, a detector's failure (a non-finite loss or gradient norm) whose cause is proven to be
    rows of the update's micro-batches is skipped: the update is replayed on the live Trainer without those rows
    and training goes on (see :mod:`reprokit.skip`). An exception inside an update is never skipped here: it has
    left the Trainer's loop by the time the callback sees it.

    Example:
        >>> trainer = Trainer(model=model, args=args, train_dataset=ds,            # doctest: +SKIP
        ...                   callbacks=[ReprokitCallback(out_dir="repros")])
    """

    def __init__(self, out_dir: str | Path = "repros", **recorder_options: Any):
        for key in ("build", "config", "train_step"):
            if key in recorder_options:
                raise CaptureError(f"ReprokitCallback makes {key} itself (the Trainer's own); drop {key}=")
        self.out_dir = Path(out_dir)
        self.options = recorder_options
        self.recorder: Recorder | None = None
        self._trainer: Trainer | None = None
        self._batch: dict[str, Any] | None = None
        self._loss: torch.Tensor | None = None
        self._indices: deque[list[int]] = deque()
        self._given: tuple[Any, list[str]] | None = None  # (weakref to a Trainer, what its constructor was given)
        self._lrs_after: list[Any] | None = None  # the optimizer's LRs as the last update left them

    # --- Trainer events ------------------------------------------------------------------

    def on_init_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        # Only the constructor's end shows whether the optimizer and scheduler are the user's own (passed as
        # ``optimizers=``): by train start the Trainer has made its own in their place.
        trainer = _calling_trainer()
        if trainer is not None:
            given = [f"optimizers=({'optimizer' if i == 0 else 'scheduler'} given)" for i, part in
                     enumerate((trainer.optimizer, trainer.lr_scheduler)) if part is not None]
            self._given = (weakref.ref(trainer), given)

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = _calling_trainer()
        if trainer is None:
            raise CaptureError("ReprokitCallback: on_train_begin was not called by a transformers Trainer; pass the "
                               "callback to Trainer(callbacks=[...])")
        missing = [name for name in _HOOKED if not callable(getattr(trainer, name, None))]
        if missing:
            raise CaptureError(f"ReprokitCallback: this Trainer ({type(trainer).__qualname__}, transformers "
                               f"{transformers.__version__}) has no {', '.join(missing)}; the callback follows the "
                               "training loop of transformers 5 (tested with 5.24): upgrade transformers")
        self._refuse_what_replay_cannot_rebuild(trainer)
        self._lrs_after = None
        if self.recorder is not None:
            self.recorder.close()
        self._trainer = trainer
        # The Trainer's events drive each update (begin_step before its first micro-batch, end_step after its
        # zero_grad or with the exception that stopped it); a model, config or Trainer class of the user's project
        # travels in the code snapshot (carry), so replay can rebuild them.
        model: Any = trainer.model
        carry = (type(model), type(trainer), type(model.config), *self.options.get("carry", ()))
        rec = Recorder(_state_of(trainer), train_step, build=build, config=self._config(trainer, state),
                       out_dir=self.out_dir, **{**self.options, "carry": carry})
        rec.step_index = int(state.global_step)  # bundle steps are the Trainer's (a resumed run starts past 0)
        self.recorder = rec
        self._wrap(trainer, kwargs.get("train_dataloader"))

    def on_epoch_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        self._indices.clear()  # a new iterator over the loader: what the last epoch left unread is dropped

    def on_step_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        rec = self.recorder
        if rec is None:
            return
        self._loss = None
        batch, self._batch = self._batch, None
        if self._lrs_after is not None and _lrs_differ(self._lrs(), self._lrs_after):
            # The LR changed between updates (a scheduler stepped on eval metrics, reduce_lr_on_plateau, or a
            # callback): replay runs updates only, so this one starts a window of its own (a fresh snapshot).
            rec.request_snapshot()
        if batch is None:  # the update's micro-batches were not seen: it cannot be replayed, nor the window
            rec.skip_step(f"reprokit: update {rec.step_index}'s micro-batches were not captured; no bundle until the "
                          "next snapshot")
            return
        rec.begin_step(batch)

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        rec = self.recorder
        if rec is None or not rec.in_step:
            return
        loss, self._loss = self._loss, None
        self._lrs_after = self._lrs(copy=True)
        rec.end_step(loss)

    def on_train_end(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder is not None:
            self.recorder.close()
        self._unwrap()

    def _refuse_what_replay_cannot_rebuild(self, trainer: Any) -> None:
        """Replay makes ``TrainerClass(model=..., args=...)`` and nothing else: a loss function, optimizer or scheduler
        handed to the constructor would be replaced by the Trainer's defaults, a replay of another run (its losses
        differ, and a deterministic failure reads "not reproduced"). Refused before the first step."""
        model = trainer.model
        config = getattr(model, "config", None)
        if not isinstance(config, PretrainedConfig):
            # The Trainer takes any torch.nn.Module; replay rebuilds the model as ModelClass(model.config).
            raise CaptureError(
                f"ReprokitCallback: the Trainer's model is a {type(model).__module__}.{type(model).__qualname__}, "
                "which has no transformers config (model.config, a PretrainedConfig), and replay rebuilds the model "
                "as its class called with that config. Make the model a transformers PreTrainedModel (with its "
                "config class), or record this run with reprokit.Recorder and your own build() and step function "
                "(see the README)")
        seen = self._given is not None and self._given[0]() is trainer
        parts = list(self._given[1]) if seen else []  # type: ignore[index]
        for name in ("compute_loss_func", "optimizer_cls_and_kwargs"):
            if getattr(trainer, name, None) is not None:
                parts.append(f"{name}=")
        if parts:
            raise CaptureError(
                f"ReprokitCallback: this Trainer was given {', '.join(parts)}, which replay cannot rebuild (it makes "
                f"{type(trainer).__qualname__}(model=..., args=...) from the recorded TrainingArguments, so it would "
                "train with the Trainer's default loss, optimizer and scheduler instead, and not reproduce the run). "
                "Move them into a Trainer subclass in your project (override compute_loss, create_optimizer, "
                "create_scheduler): the subclass travels in the bundle's code snapshot and replay runs it")
        why = None if seen else _not_the_trainers_own(trainer)
        if why is not None:
            # Added with trainer.add_callback: the constructor's end (and its optimizers=) went unseen.
            raise CaptureError(
                f"ReprokitCallback: it was added after this Trainer was made (trainer.add_callback), so it did not see "
                f"what the constructor was given, and {why}. Replay makes {type(trainer).__qualname__}(model=..., "
                "args=...) from the recorded TrainingArguments and would train with the optimizer and scheduler that "
                "Trainer makes itself, not reproducing this run. If the Trainer was given optimizers=, move them into "
                "a Trainer subclass in your project (override create_optimizer, create_scheduler): the subclass "
                "travels in the bundle's code snapshot and replay runs it. If it was not, pass the callback in "
                "Trainer(callbacks=[ReprokitCallback(...)]), where it sees the constructor's arguments")

    def _lrs(self, copy: bool = False) -> list[Any]:
        """The optimizer's LRs; with ``copy``, a tensor LR (which a scheduler changes in place) as a copy on its
        device, queued in stream order: no sync."""
        trainer = self._trainer
        opt = _unwrap(trainer.optimizer, "optimizer") if trainer is not None else None
        lrs = [group.get("lr") for group in getattr(opt, "param_groups", [])]
        return [lr.detach().clone() if copy and isinstance(lr, torch.Tensor) else lr for lr in lrs]

    # --- what the bundle needs --------------------------------------------------------------

    def _config(self, trainer: Any, state: Any) -> dict[str, Any]:
        model = trainer.model
        dtypes = {p.dtype for p in model.parameters()}
        dtype = str(next(iter(dtypes)) if len(dtypes) == 1 else torch.float32).removeprefix("torch.")
        return {
            "transformers": transformers.__version__,
            "trainer": {"class": _class_ref(type(trainer), "Trainer")},
            "model": {"class": _class_ref(type(model), "model"), "config_class": _class_ref(type(model.config),
                                                                                             "model config"),
                      "config": model.config.to_dict(), "dtype": dtype},
            "args": _args_to_record(trainer.args),
            "max_steps": int(state.max_steps),
            N_GPU: int(trainer.args.n_gpu),  # replay refuses another count where DataParallel is in play
        }

    # --- wrapping the Trainer instance -------------------------------------------------------

    def _wrap(self, trainer: Trainer, loader: Any) -> None:
        self._unwrap()
        get_batch_samples, training_step, run_epoch = (trainer.get_batch_samples, trainer.training_step,
                                                       trainer._run_epoch)

        def batch_samples(epoch_iterator: Any, num_batches: int, device: Any) -> Any:
            samples, num_items = get_batch_samples(epoch_iterator, num_batches, device)
            try:
                self._batch = self._update_batch(samples, num_items)
            except Exception:  # never let the recorder stop training: on_step_begin says the update is lost
                self._batch = None
            return samples, num_items

        def step(model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            loss = training_step(model, inputs, num_items_in_batch)
            self._loss = loss if self._loss is None else self._loss + loss
            return loss

        def epoch(*a: Any, **kw: Any) -> Any:
            try:
                return run_epoch(*a, **kw)
            except Exception as e:
                rec = self.recorder
                if rec is not None and rec.in_step:
                    rec.end_step(None, exc=e)  # writes the bundle, then raises e with a note naming it
                raise

        trainer.get_batch_samples = batch_samples  # type: ignore[method-assign]
        trainer.training_step = step  # type: ignore[method-assign]
        trainer._run_epoch = epoch  # type: ignore[method-assign]
        loader = getattr(loader, "base_dataloader", loader)  # accelerate's DataLoaderShard wraps the DataLoader
        sampler = getattr(loader, "batch_sampler", None)
        if sampler is not None and not isinstance(sampler, _IndexedBatches):
            # DataLoader refuses a new batch_sampler after __init__ through setattr; its iterators read the attribute
            object.__setattr__(loader, "batch_sampler", _IndexedBatches(sampler, self._indices))
            self._loader = loader

    def _unwrap(self) -> None:
        trainer = self._trainer
        if trainer is not None:
            for name in ("get_batch_samples", "training_step", "_run_epoch"):  # the instance attributes _wrap set
                trainer.__dict__.pop(name, None)
        loader = getattr(self, "_loader", None)
        if loader is not None and isinstance(loader.batch_sampler, _IndexedBatches):
            object.__setattr__(loader, "batch_sampler", loader.batch_sampler._inner)
        self._loader = None

    def _update_batch(self, samples: list[Any], num_items: Any) -> dict[str, Any]:
        micro = []
        for inputs in samples:
            entry: dict[str, Any] = {"inputs": inputs}
            indices = self._indices.popleft() if self._indices else None
            rows = _rows(inputs)
            if indices is not None and rows is not None and len(indices) == rows:
                entry["index"] = torch.tensor(indices, dtype=torch.long)
            micro.append(entry)
        batch: dict[str, Any] = {MICRO: micro}
        trainer = self._trainer
        if trainer is not None and trainer.accelerator.num_processes > 1 and num_items is not None:
            batch[NUM_ITEMS] = num_items  # gathered over ranks: a single-process replay cannot count it again
        return batch


def _lrs_differ(now: list[Any], before: list[Any]) -> bool:
    """Whether any LR differs from its earlier value: numbers on the host; tensors compared on their device and read
    back together, one sync per device for all groups (reading each group's LR before and after an update took two
    per group)."""
    if len(now) != len(before):
        return True
    unequal: dict[torch.device, list[torch.Tensor]] = {}
    for a, b in zip(now, before, strict=True):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
                return True
            unequal.setdefault(a.device, []).append(torch.ne(a, b).any())  # NaN reads as changed, as float() did
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or a != b:
            return True
    return any(bool(torch.stack(flags).any()) for flags in unequal.values())


def _not_the_trainers_own(trainer: Any) -> str | None:
    """Why the optimizer or LR scheduler may not be the one replay's Trainer makes (None: it is), for a Trainer whose
    constructor the callback did not see.

    An optimizer or scheduler given to the constructor (``optimizers=``) leaves no mark on the Trainer, so each is
    compared with what ``Trainer.create_optimizer`` / ``create_scheduler`` make from the same arguments and model. A
    Trainer subclass that overrides one of them makes its own on replay too (it travels in the code snapshot).
    """
    cls = type(trainer)
    if cls.create_optimizer is Trainer.create_optimizer:
        why = _optimizer_differs(trainer)
        if why is not None:
            return why
    # create_scheduler sets this flag only when it made the scheduler itself (the Trainer rebuilds only those on a
    # later train()); a scheduler given as optimizers=(..., scheduler) never has it.
    if cls.create_scheduler is Trainer.create_scheduler and getattr(trainer, "_created_lr_scheduler", None) is not True:
        return (f"its LR scheduler ({type(_unwrap(trainer.lr_scheduler, 'scheduler')).__qualname__}) was not made by "
                "Trainer.create_scheduler")
    return None


def _optimizer_differs(trainer: Any) -> str | None:
    """How the Trainer's optimizer differs from the one ``Trainer.create_optimizer`` makes (None: it does not): its
    class, its parameter groups (decayed, then not) and every hyperparameter of each group."""
    opt = _unwrap(trainer.optimizer, "optimizer")
    args, model = trainer.args, trainer.model
    try:
        opt_cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)
        kwargs = dict(kwargs)
        if not (isinstance(opt_cls, type) and issubclass(opt_cls, torch.optim.Optimizer)) \
                or {"params", "model", "optimizer_dict"} & kwargs.keys():
            return (f"for optim={args.optim!r} the Trainer builds its optimizer in a way reprokit cannot compare "
                    "with the one it trains with")
        decay = set(trainer.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        # A torch optimizer holds no state until it steps: this one only fills in each group's defaults.
        expected = opt_cls(groups, **kwargs).param_groups
    except Exception as e:
        return (f"the optimizer the Trainer would make could not be built to compare with its own "
                f"({type(e).__name__}: {e})")
    if type(opt) is not opt_cls:
        return (f"its optimizer is a {type(opt).__module__}.{type(opt).__qualname__}, where the Trainer makes a "
                f"{opt_cls.__module__}.{opt_cls.__qualname__} (optim={args.optim!r})")
    if len(opt.param_groups) != len(expected):
        n = len(opt.param_groups)
        return (f"its optimizer has {n} parameter group{'s' if n != 1 else ''}, where the Trainer makes "
                f"{len(expected)} (weight-decayed parameters, then the others)")
    for i, (got, want) in enumerate(zip(opt.param_groups, expected, strict=True)):
        why = _group_differs(got, want)
        if why is not None:
            return f"its optimizer's parameter group {i} {why}"
    return None


def _group_differs(got: dict[str, Any], want: dict[str, Any]) -> str | None:
    """How a parameter group differs from the Trainer's (None: it does not). Its LR is compared as the group started
    (``initial_lr``, which the Trainer's schedulers set and scale from), not as a warmup left it."""
    if [id(p) for p in got["params"]] != [id(p) for p in want["params"]]:
        return "holds other parameters than the Trainer's would (weight-decayed parameters, then the others)"
    for key, value in want.items():
        have = got.get("initial_lr", got.get("lr")) if key == "lr" else got.get(key, _ABSENT)
        if key != "params" and not _same(have, value):
            return f"has {key}={'(none)' if have is _ABSENT else have!r}, where the Trainer's would have {value!r}"
    return None


_ABSENT = object()


def _same(a: Any, b: Any) -> bool:
    """Equal hyperparameters: a tensor only equals a tensor of the same dtype, device and value."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.device == b.device and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:
        return False


def _rows(inputs: Any) -> int | None:
    if isinstance(inputs, dict):
        for v in inputs.values():
            if isinstance(v, torch.Tensor) and v.dim() >= 1:
                return int(v.shape[0])
    return None


def _class_ref(cls: type, what: str) -> dict[str, Any]:
    ref, root = ref_of(cls, what)
    if root is None and str(ref.get("module", "")).split(".")[0] != "transformers":
        raise CaptureError(f"ReprokitCallback: the {what} class {cls.__module__}.{cls.__qualname__} comes from an "
                           "installed package other than transformers; replay rebuilds only transformers' classes "
                           "and your project's own")
    return ref


def _calling_trainer() -> Trainer | None:
    """The Trainer whose event is being handled: the nearest ``self`` up the stack that is one."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            obj = frame.f_locals.get("self")
            if isinstance(obj, Trainer):
                return obj
            frame = frame.f_back
    finally:
        del frame
    return None

