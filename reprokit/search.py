"""Pure search primitives used by the shrinker and the bisectors.

Each takes a predicate and returns an answer; none touches torch or disk, so
they are tested on their own (including with Hypothesis).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def find_integer(f: Callable[[int], bool]) -> int:
    """Largest ``n >= 0`` with ``f(n)`` true, assuming ``f(0)`` is (``f`` is never called with 0).

    Tries 1..4 first (small answers are common and cheap), then probes
    exponentially, then binary-searches the last gap: O(log n) calls.

    Example:
        >>> find_integer(lambda n: n <= 37)
        37
    """
    for i in range(1, 5):
        if not f(i):
            return i - 1
    lo, hi = 4, 8
    while f(hi):
        lo, hi = hi, hi * 2
    # Invariant: f(lo) is true, f(hi) is false.
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if f(mid):
            lo = mid
        else:
            hi = mid
    return lo


def ddmin(items: Sequence[T], fails: Callable[[list[T]], bool]) -> list[T]:
    """Delta debugging: a 1-minimal sub-list of ``items`` for which ``fails`` holds.

    ``fails(items)`` is assumed true. A single culprit among n is found in at most
    2*ceil(log2 n) calls; culprits that only fail together are all kept. Order is
    preserved.

    Example:
        >>> ddmin(list(range(100)), lambda xs: 42 in xs and 7 in xs)
        [7, 42]
    """
    current = list(items)
    n = 2
    while len(current) >= 2:
        chunks = _split(current, n)
        reduced = False
        for chunk in chunks:  # reduce to one chunk
            if fails(chunk):
                current, n, reduced = chunk, 2, True
                break
        if not reduced and n > 2:
            for i in range(len(chunks)):  # reduce to a complement
                complement = [x for j, c in enumerate(chunks) if j != i for x in c]
                if fails(complement):
                    current, n, reduced = complement, max(n - 1, 2), True
                    break
        if not reduced:
            if n >= len(current):
                break
            n = min(len(current), 2 * n)
    return current


def _split(xs: list[T], n: int) -> list[list[T]]:
    size, extra = divmod(len(xs), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(xs[start:end])
        start = end
    return [c for c in out if c]


def shortest_window(n: int, fails: Callable[[int, int], bool]) -> tuple[int, int]:
    """A short ``[lo, hi)`` inside ``[0, n)`` for which ``fails(lo, hi)`` holds.

    Trims the suffix, then the prefix, each with :func:`find_integer`
    (O(log n) calls each, never one position at a time). ``fails(0, n)`` is assumed.

    Example:
        >>> shortest_window(256, lambda lo, hi: lo <= 100 < hi)
        (100, 101)
    """
    cut_end = find_integer(lambda k: k < n and fails(0, n - k))
    hi = n - cut_end
    cut_start = find_integer(lambda k: k < hi and fails(k, hi))
    return cut_start, hi
