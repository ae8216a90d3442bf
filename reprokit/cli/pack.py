"""``reprokit pack``: a bundle folder into one deterministic tarball and its ``.sha256``."""

from __future__ import annotations

from pathlib import Path

import click

from reprokit.cli.inputs import _refuse_folder_of_bundles
from reprokit.cli.options import _writable, accept_generated_opt, bundle_arg, json_opt
from reprokit.cli.output import _echo, _emit


def _archive_name(ctx: click.Context, param: click.Parameter, value: Path | None) -> Path | None:
    """``pack -o``: a name that says what the file is (a tarball named .zip would be opened as a zip and fail)."""
    if value is not None and not value.name.endswith((".tar", ".tar.gz", ".tgz")):
        raise click.BadParameter(f"{value.name} does not end in .tar, .tar.gz or .tgz; pack writes a tarball "
                                 f"(try {value.with_suffix('').name or value.name}.tar)")
    return _writable(ctx, param, value)


@click.command()
@bundle_arg
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False, path_type=Path), callback=_archive_name,
              help="The archive to write: OUTPUT.tar (uncompressed) or OUTPUT.tar.gz (gzip on every core, only where "
                   "it saves 10% or more: float32 tensors, which it shrinks by ~7%, are stored as they are); "
                   "OUTPUT.sha256 is written beside it.")
@click.option("--force", is_flag=True, help="Replace OUTPUT (and its .sha256) if it exists.")
@accept_generated_opt
@json_opt
def pack(bundle: Path, output: Path, force: bool, as_json: bool) -> None:
    """Pack BUNDLE into a deterministic tarball that replays with only torch, numpy and safetensors.

    BUNDLE is a bundle folder (an archive is packed already). Inside the tarball: the
    bundle, repro.py, the reprokit runtime and a README. Send the archive and its
    .sha256; the receiver runs `python repro.py`. Exit 0 written; 2 OUTPUT exists
    (--force replaces it); 3 not a bundle folder, or an invalid or tampered bundle.
    """
    from reprokit.pack import pack as do_pack

    if not bundle.is_dir():
        from reprokit.errors import BundleError

        raise BundleError(f"{bundle} is not a bundle folder; pack takes the folder the recorder wrote "
                          "(a .tar or .tar.gz is already packed: send it with its .sha256)")
    _refuse_folder_of_bundles(bundle)
    if output.exists() and not force:  # said before packing; a tarball sent earlier is not replaced unasked
        raise click.BadParameter(f"{output} already exists; pick another name, or pass --force to replace it",
                                 param_hint="-o")
    from reprokit.report import format_pack

    r = do_pack(bundle, output).to_json()
    _emit(r) if as_json else _echo(format_pack(r, output.name))
