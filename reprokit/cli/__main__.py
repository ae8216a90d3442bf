"""``python -m reprokit.cli``: the same as ``python -m reprokit`` and ``reprokit``."""

from reprokit.cli import main

main()
