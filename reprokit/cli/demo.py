"""``reprokit demo``: the whole story on a tiny model, from a poisoned sample to a verified tarball."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from reprokit.cli.options import _folder_to_write_into, json_opt
from reprokit.cli.output import _echo, _emit


@click.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None, callback=_folder_to_write_into,
              help="Where to write the bundle (default: a temporary directory).")
@json_opt
def demo(out: Path | None, as_json: bool) -> None:
    """Train a tiny model until a poisoned sample kills it, then replay, shrink, localise, pack and verify the bundle."""
    from reprokit.demo_story import run_demo

    if out is not None and (out / "manifest.json").exists():  # files added to a bundle break its manifest
        raise click.BadParameter(f"{out} is a bundle folder; the demo would write its own bundle, shrunk copy and "
                                 "tarball into it, and that bundle would no longer verify. Give a new or empty "
                                 "folder (or leave --out out: a temporary one)", param_hint="--out")
    taken = [name for name in ("shrunk", "repro.tar.gz") if out is not None and (out / name).exists()]
    if taken:  # said before training, not after it
        raise click.BadParameter(f"{out} already holds {' and '.join(taken)} from an earlier demo; give a new or "
                                 "empty folder (or leave --out out: a temporary one)", param_hint="--out")
    out = out or Path(tempfile.mkdtemp(prefix="reprokit-demo-"))
    result = run_demo(out, say=(lambda s: None) if as_json else _echo)
    if as_json:
        _emit(result)
