"""The BUNDLE argument of a command: a bundle folder, a packed archive (extracted safely), or a flight folder to
recover first; and the checks of ``--code``/``--entry`` against the bundle opened."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from reprokit.cli.output import _echo


def _refuse_folder_of_bundles(path: Path) -> None:
    from reprokit.bundle import folder_of_bundles
    from reprokit.errors import BundleError

    message = folder_of_bundles(path)
    if message:
        raise BundleError(message)


def _confirm_entries(opened: Any, code: Path | None, entries: tuple[str, ...]) -> None:
    """With --code, refuse (exit 2) refs of the opened bundle that --entry does not name; without, refuse --entry."""
    from reprokit.code import confirm_entries

    if code is None:
        if entries:
            raise click.UsageError("--entry only applies with --code (the bundle's own snapshot runs its own refs)")
        return
    confirm_entries(opened.run.get("refs"), entries, code, snapshot=opened.code_dir, source=opened.path / "run.json")


def _open(bundle: Path, kw: dict[str, Any]) -> Any:
    """Context manager yielding a bundle folder for a folder or a (safely extracted) archive."""
    from reprokit.archive import Limits, bundle_dir

    _refuse_folder_of_bundles(bundle)
    limits = Limits(max_members=kw.pop("max_members"), max_file_bytes=kw.pop("max_file_bytes"),
                    max_total_bytes=kw.pop("max_total_bytes"), max_ratio=kw.pop("max_ratio"))
    return bundle_dir(bundle, sha256=kw.pop("sha256"), limits=limits)


def _recovered(bundle: Path, as_json: bool) -> Path:
    """A flight folder (or an out_dir holding dead runs' flight logs) given where a bundle goes: recover it first."""
    from reprokit.recover import recovered_input

    path, note = recovered_input(bundle)
    if note:
        _echo(note, err=True)
    return path
