"""The ``reprokit`` command line. Thin: parse, call the library, print, exit.

Exit codes: 0 ok / not reproduced, 1 reproduced (replay) or problems found
(verify), 2 usage error, 3 invalid or tampered bundle, 125 the code cannot be
imported or the state does not fit (``git bisect run`` skips such commits).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from reprokit import bundle as B
from reprokit.errors import ReprokitError

CONTEXT = {"help_option_names": ["-h", "--help"], "auto_envvar_prefix": "REPROKIT"}


def _emit(obj: dict[str, Any]) -> None:
    click.echo(json.dumps(B.jsonable(obj), indent=2, sort_keys=False))


class _Group(click.Group):
    """Turns every ReprokitError into a clean message and its exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ReprokitError as e:
            click.echo(f"Error: {e}", err=True)
            sys.exit(e.exit_code)


@click.group(cls=_Group, context_settings=CONTEXT)
@click.version_option(package_name="reprokit")
def main() -> None:
    """reprokit: turn a failing training run into a small, portable repro.

    A bundle is a test case: `replay` exits 1 while the failure reproduces and
    0 once it is fixed, so `git bisect run reprokit replay BUNDLE --code .` works.
    """


bundle_arg = click.argument("bundle", type=click.Path(exists=True, path_type=Path))
json_opt = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")


@main.command()
@bundle_arg
@click.option("--times", "-n", default=1, show_default=True, type=click.IntRange(1, 1000),
              help="Replay this many times to tell deterministic from flaky.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None,
              help="Where to replay (default: where it was recorded, if available).")
@click.option("--code", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Import build/step from this checkout instead of the bundle's code snapshot.")
@json_opt
def replay(bundle: Path, times: int, device: str | None, code: Path | None, as_json: bool) -> None:
    """Re-run BUNDLE and report whether it fails the same way.

    Exit 1 if the failure reproduces in at least one run, 0 if not (fixed),
    3 if the bundle is invalid or tampered with.
    """
    from reprokit.replay import replay as do_replay

    progress = None if as_json or times == 1 else (
        lambda i, n: click.echo(f"\r  replay {i}/{n}", nl=i == n, err=True))
    report = do_replay(bundle, times=times, device=device, code=code, progress=progress)
    d = report.to_json()
    if as_json:
        _emit(d)
    else:
        click.echo(format_replay(d))
    sys.exit(1 if report.reproduced else 0)


def format_replay(d: dict[str, Any]) -> str:
    rec, got, fid = d["recorded_failure"], d["failure"], d["fidelity"]
    head = {"deterministic": "REPRODUCED", "flaky": "REPRODUCED (flaky)", "not_reproduced": "NOT REPRODUCED"}
    lines = [f"{head[d['verdict']]}: {d['failed_runs']}/{d['runs']} runs failed the same way ({d['verdict']})",
             f"  recorded: {_fail_line(rec)}"]
    if got and not d["reproduced"]:
        lines.append(f"  replay hit a DIFFERENT failure: {_fail_line(got)}")
    elif got:
        lines.append(f"  replayed: {_fail_line(got)}")
    exact = "bit-exact" if fid["bit_exact"] else f"max abs diff {fid['max_abs_diff']:.3g}"
    lines.append(f"  fidelity: {fid['steps_compared']} step losses compared, {exact}")
    lines.append(f"  device {d['device']}, code from {d['code']}")
    return "\n".join(lines)


def _fail_line(f: dict[str, Any] | None) -> str:
    if not f:
        return "none"
    what = f"{f['exception_type']}: {f['message']}" if f["exception_type"] else f"{f['kind']} ({f['message']})"
    return f"{what} at step {f['step']}" + (f" in {f['frame']}" if f.get("frame") else "")


@main.command()
@bundle_arg
@json_opt
def inspect(bundle: Path, as_json: bool) -> None:
    """Show BUNDLE's failure, window, batch structure, state sizes, env and losses."""
    from reprokit.report import describe, format_describe

    d = describe(B.open_bundle(bundle))
    _emit(d) if as_json else click.echo(format_describe(d))


@main.command()
@bundle_arg
@json_opt
def verify(bundle: Path, as_json: bool) -> None:
    """Check every file of BUNDLE against its manifest; exit 1 if anything is wrong."""
    problems = B.verify(bundle)
    if as_json:
        _emit({"bundle": str(bundle), "ok": not problems, "problems": problems})
    elif problems:
        click.echo(f"{bundle}: {len(problems)} problem(s)")
        for p in problems:
            extra = "".join(f", {k} {p[k]}" for k in ("expected", "found") if k in p)
            click.echo(f"  {p['file']}: {p['problem']}{extra}")
    else:
        click.echo(f"{bundle}: ok, every file matches the manifest")
    sys.exit(1 if problems else 0)


@main.command()
@bundle_arg
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path),
              help="Directory for the shrunk bundle (must not exist, or be empty).")
@click.option("--budget", default=300, show_default=True, type=click.IntRange(1),
              help="Most candidate replays to spend.")
@click.option("--passes", default=",".join(["steps", "rows", "sequence", "tokens"]), show_default=True,
              help="Comma-separated passes to run, in order.")
@click.option("--pad-id", default=0, show_default=True, type=int,
              help="Neutral value for integer tensors in the tokens pass (your tokenizer's pad id).")
@click.option("--isolate", is_flag=True, help="Replay each candidate in a subprocess (segfaults, hangs).")
@click.option("--timeout", default=60.0, show_default=True, type=click.FloatRange(0, min_open=True),
              help="Seconds per isolated candidate before it counts as not failing.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=None, help="Where to replay candidates.")
@click.option("--code", type=click.Path(exists=True, file_okay=False, path_type=Path), default=None,
              help="Import build/step from this checkout instead of the bundle's code snapshot.")
@json_opt
def shrink(bundle: Path, output: Path, budget: int, passes: str, pad_id: int, isolate: bool, timeout: float,
           device: str | None, code: Path | None, as_json: bool) -> None:
    """Minimise BUNDLE to the fewest steps, rows, sequence positions and tokens that fail the same way.

    Exit 0 with the shrunk bundle written to OUTPUT; exit 1 if BUNDLE does not
    reproduce to begin with.
    """
    from reprokit.shrink import shrink as do_shrink

    def progress(name: str, replays: int, size: str) -> None:
        click.echo(f"\r  {name:<9} replays {replays:>4}/{budget}  best: {size}\033[K", nl=False, err=True)

    result = do_shrink(bundle, output, budget=budget, passes=[p.strip() for p in passes.split(",") if p.strip()],
                       pad_id=pad_id, isolate=isolate, timeout=timeout, device=device, code=code,
                       progress=None if as_json else progress)
    if not as_json:
        click.echo("", err=True)
    d = result.to_json()
    _emit(d) if as_json else click.echo(format_shrink(d))


def format_shrink(d: dict[str, Any]) -> str:
    rows = [(k, d[f"{k}_before"], d[f"{k}_after"]) for k in ("steps", "rows", "seq", "tokens")]
    lines = [f"shrunk in {d['replays']} replays ({d['seconds']:.1f}s)"
             + (" - budget exhausted, result may not be minimal" if d["budget_exhausted"] else ""),
             f"  {'':<8}{'before':>10}{'after':>10}"]
    lines += [f"  {k:<8}{b if b is not None else '-':>10}{a if a is not None else '-':>10}" for k, b, a in rows]
    if d["kept_rows"] is not None:
        lines.append(f"  kept rows {d['kept_rows']} of the failing batch"
                     + (f" (dataset indices {d['dataset_indices']})" if d["dataset_indices"] else ""))
    if d["seq_window"]:
        lines.append(f"  sequence window {d['seq_window'][0]}:{d['seq_window'][1]}")
    lines.append("  passes: " + ", ".join(f"{k} {v['accepted']}/{v['runs']} accepted, {v['replays']} replays"
                                          for k, v in d["passes"].items()))
    lines.append(f"  still fails: {_fail_line(d['failure'])}")
    lines.append(f"wrote {d['output']}")
    return "\n".join(lines)


@main.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where to write the bundle (default: a temporary directory).")
@json_opt
def demo(out: Path | None, as_json: bool) -> None:
    """Train a tiny model until a poisoned sample kills it, then replay the bundle."""
    from reprokit.demo_cli import run_demo

    out = out or Path(tempfile.mkdtemp(prefix="reprokit-demo-"))
    result = run_demo(out, say=(lambda s: None) if as_json else click.echo)
    if as_json:
        _emit(result)


if __name__ == "__main__":  # pragma: no cover
    main()
