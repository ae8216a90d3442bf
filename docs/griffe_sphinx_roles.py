"""A griffe extension for the API reference: reprokit's docstrings are Google style with Sphinx cross-reference
roles (``:class:`TrainState```, ``:func:`open_bundle```, ``:meth:`Session.run```), which mkdocstrings does not
read; each role becomes plain inline code, so the page shows ``TrainState`` and not ``:class:TrainState``."""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const):`~?([^`]+)`")


class SphinxRoles(Extension):
    def on_object(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(r"`\1`", obj.docstring.value)
