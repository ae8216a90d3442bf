"""The caps applied while opening an archive from someone else (:class:`Limits`; :mod:`reprokit.archive` opens it).

A module of its own, importing nothing of reprokit: the command line builds its ``--max-*`` options from these
defaults while it starts (``reprokit --help`` included), and :mod:`reprokit.archive` imports the bundle reader.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(kw_only=True, slots=True)
class Limits:
    """Caps applied while opening an archive (defaults sized for real model state)."""

    max_members: int = 100_000
    """Most members (files and directories) an archive may hold."""
    max_file_bytes: int = 64 * GiB
    """Largest single file, as declared in its header."""
    max_total_bytes: int = 256 * GiB
    """Most bytes, all files together, after decompression."""
    max_ratio: float = 200.0
    """Most decompressed bytes per compressed byte, checked once 256 MiB are out (gzip bombs)."""
    max_header_bytes: int = 1 << 16
    """Largest extended header (a pax record block, a GNU long name): a path needs a few hundred bytes."""

    def __post_init__(self) -> None:
        for name in ("max_members", "max_file_bytes", "max_total_bytes", "max_ratio", "max_header_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} must be positive, got {getattr(self, name)}")
