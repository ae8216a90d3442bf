"""The journal of a run's skips: ``out_dir/skips.jsonl``, one JSON line per skipped failure.

:class:`reprokit.skip.Skipper` appends to it (:func:`append_entry`); :func:`read_journal`, :func:`skip_list` and
:func:`describe_skips` read it. Torch-free, so that ``reprokit inspect OUT_DIR`` answers without importing torch.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from reprokit.bundle import jsonable
from reprokit.errors import RecorderWarning, ReprokitError

JOURNAL = "skips.jsonl"
"""The file name of the journal, in ``out_dir``."""
JOURNAL_FORMAT = "reprokit-skip"
JOURNAL_VERSION = 1


def append_entry(path: Path, entry: dict[str, Any]) -> None:
    """Append one JSON line to the journal, in one ``write`` on a file opened for appending, then fsync: a line is
    whole or absent (a crash mid-write leaves at most a last line without its newline, which readers skip)."""
    line = (json.dumps(jsonable(entry), sort_keys=True) + "\n").encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def journal_path(where: str | os.PathLike[str]) -> Path:
    """The journal of ``where``: an ``out_dir`` (its ``skips.jsonl``) or the journal file itself."""
    p = Path(where)
    return p / JOURNAL if p.is_dir() else p


def read_journal(where: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every skip in the journal of ``where`` (an ``out_dir`` or its ``skips.jsonl``), oldest first; an empty list
    when there is none. A last line without its newline (a write cut short) is left out.

    Raises:
        ReprokitError: a complete line is not a journal entry (the file was edited or is not a journal).
    """
    path = journal_path(where)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    lines = text.split("\n")
    entries = []
    for number, line in enumerate(lines[:-1], 1):  # the part after the last newline is empty, or cut short
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if not isinstance(entry, dict) or entry.get("format") != JOURNAL_FORMAT or not isinstance(entry.get("step"), int):
            raise ReprokitError(f"{path}:{number} is not a reprokit skip entry; the journal was edited or is another "
                                "file. Fix or remove that line.")
        entries.append(entry)
    return entries


def skip_list(out_dir: str | os.PathLike[str]) -> list[Any]:
    """The dataset indices a run with ``on_failure="skip"`` skipped, from its journal (``out_dir/skips.jsonl``):
    sorted, each once. Give them to a run resumed from a checkpoint, so that it never meets those samples again,
    either as ``Recorder(skip_indices=...)`` (it drops their rows from the batches it is given) or to your sampler.

    A skip whose batch carried no dataset index leaf has no index to return: a warning says how many.

    Example:
        >>> bad = set(reprokit.skip_list("repros"))                                  # doctest: +SKIP
        >>> sampler = [i for i in range(len(dataset)) if i not in bad]              # doctest: +SKIP
    """
    entries = read_journal(out_dir)
    found: set[Any] = set()
    unnamed = []
    for e in entries:
        indices = e.get("dataset_indices")
        if indices is None:
            unnamed.append(e["step"])
        else:
            found.update(indices)
    if unnamed:
        warnings.warn(f"reprokit: the skips at steps {unnamed} name no dataset index (their batches carried none), "
                      "so skip_list cannot return them; `reprokit inspect OUT_DIR` shows their rows", RecorderWarning,
                      stacklevel=2)
    return sorted(found, key=lambda v: (isinstance(v, str), v))


def describe_skips(where: str | os.PathLike[str]) -> dict[str, Any]:
    """What ``reprokit inspect OUT_DIR`` reports of a run's skips: the journal and each entry."""
    path = journal_path(where)
    entries = read_journal(path)
    return {"journal": str(path), "skips": entries, "count": len(entries),
            "dataset_indices": sorted({i for e in entries for i in (e.get("dataset_indices") or [])},
                                      key=lambda v: (isinstance(v, str), v)),
            "seconds_lost": round(sum(float(e.get("seconds_lost") or 0) for e in entries), 3)}
