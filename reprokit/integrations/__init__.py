"""Integrations with training frameworks.

Each submodule imports its framework lazily (only when the submodule itself is imported), so
``import reprokit`` never pulls in transformers, lightning or accelerate:

* ``reprokit.integrations.transformers``: a ``TrainerCallback`` for the Hugging Face ``Trainer``.
* ``reprokit.integrations.lightning``: a Lightning ``Callback``.
* accelerate needs no module here: ``TrainState`` takes its ``AcceleratedOptimizer`` and ``AcceleratedScheduler``
  as they are (see :func:`reprokit.state.unwrap_optimizer`).
"""
