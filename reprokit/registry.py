"""Extension points (shrink passes, bisect axes, precision variants) list their names once, in a registry module of
their own package that imports no torch (:mod:`reprokit.shrink.registry`, :mod:`reprokit.bisect.registry`): the
command line reads those for its help and defaults. The module implementing them binds each name to its code here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

T = TypeVar("T")


def bind(names: Iterable[str], implementations: Mapping[str, T], what: str) -> dict[str, T]:
    """``implementations`` in the registry's order of ``names``; refused (at import) unless it implements exactly the
    names the registry lists, so a name added to one and not the other never gets as far as a run.

    Example:
        >>> bind(("a", "b"), {"b": 2, "a": 1}, "letters")
        {'a': 1, 'b': 2}
    """
    names = list(names)
    missing = [n for n in names if n not in implementations]
    extra = [n for n in implementations if n not in names]
    if missing or extra:
        raise RuntimeError(f"the {what} the registry lists ({', '.join(names)}) and those implemented differ: "
                           f"{missing} not implemented, {extra} not in the registry")
    return {name: implementations[name] for name in names}
