"""Integrations with training frameworks.

Each submodule imports its framework lazily (only when the submodule itself is imported), so
``import reprokit`` never pulls in transformers, lightning or accelerate:

* ``reprokit.integrations.transformers``: a ``TrainerCallback`` for the Hugging Face ``Trainer``.
* ``reprokit.integrations.lightning``: a Lightning ``Callback``.
* ``reprokit.integrations.accelerate``: helpers for loops prepared by ``accelerate``.
"""
