"""``python -m reprokit.cli``: the same as ``python -m reprokit`` and ``reprokit``."""

from reprokit.cli import main

if __name__ == "__main__":  # imported (the docs' module walk, doctest collection), it runs nothing
    main()
