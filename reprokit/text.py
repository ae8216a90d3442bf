"""Text that comes from a bundle, made safe to print on a terminal."""

from __future__ import annotations

import re

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""Control characters other than newline and tab (C0, DEL, C1), and the bidirectional overrides."""


def printable(text: str) -> str:
    """``text`` with control characters (except newline and tab) written as escapes (``\\x1b``, ``\\r``, ``\\u202e``).

    A bundle from elsewhere carries messages, tracebacks and names that would otherwise reach the terminal raw: an
    escape sequence can clear the screen, retitle the window or write the clipboard, a carriage return or a
    right-to-left override can make a line read as something else.
    """
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)


_LINE_BREAKING = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def one_line(text: str) -> str:
    """``text`` as one line: :func:`printable`, with newlines and tabs escaped too (``\\n``, ``\\t``), and the
    Unicode line and paragraph separators.

    For the names of files and anything else a bundle holds that is printed as part of a line: a file name holding a
    newline would otherwise print a line of its own, say a forged "ok, every file matches the manifest".
    """
    return _LINE_BREAKING.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
