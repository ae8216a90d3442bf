"""The resolved paths of loaded modules' files, which the code snapshot and a replay's clean-up read for every module
in ``sys.modules``: each folder is resolved once (:func:`reprokit.code._real_path`), with the answer of
``os.path.realpath`` whatever mix of folder links, file links and plain files the paths go through."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from reprokit.code import _real_path, _under, snapshot_files


def _tree(root: Path) -> list[str]:
    """Folders and files reached through folder links, file links, a link to a link and a dangling link."""
    (root / "real" / "pkg").mkdir(parents=True)
    (root / "other").mkdir()
    for name in ("a.py", "b.py"):
        (root / "real" / "pkg" / name).write_text("")
    (root / "other" / "c.py").write_text("")
    (root / "linked").symlink_to(root / "real")  # a folder link
    (root / "real" / "pkg" / "to_c.py").symlink_to(root / "other" / "c.py")  # a file link out of the folder
    (root / "real" / "pkg" / "twice.py").symlink_to(root / "real" / "pkg" / "to_c.py")  # a link to a link
    (root / "real" / "pkg" / "gone.py").symlink_to(root / "nowhere.py")  # dangling
    (root / "relative").symlink_to("real/pkg")  # a relative folder link
    names = ("a.py", "b.py", "to_c.py", "twice.py", "gone.py", "missing.py", "", ".", "..")
    folders = (root / "real" / "pkg", root / "linked" / "pkg", root / "relative", root / "real" / "pkg" / ".." / "pkg")
    return [f"{folder}/{name}" for folder in folders for name in names]  # "pkg/", "pkg/." and "pkg/.." as written


def test_each_module_path_resolves_as_realpath_does(tmp_path):
    paths = _tree(tmp_path)
    folders: dict[str, str] = {}
    for path in paths + paths:  # the second pass reads the folders' cache
        assert _real_path(path, folders) == os.path.realpath(path) == str(Path(path).resolve()), path
    assert len(folders) == 4


_PARTS = st.lists(st.sampled_from(["a", "b", "ab", "ba", "a.b"]), min_size=0, max_size=4)


@settings(max_examples=300, deadline=None)
@given(_PARTS, _PARTS, _PARTS)
def test_under_is_path_parents(common, folder_tail, path_tail):
    """Folder and path drawn apart from shared parts: siblings whose names share a prefix (``/a/b``, ``/a/bc``)
    come up as often as parents and children."""
    folder = "/" + "/".join(common + folder_tail)
    path = "/" + "/".join(common + path_tail)
    for f, p in ((folder, path), (path, folder), ("/", path), (folder, "/")):
        assert _under(p, f) == (Path(f) in Path(p).parents), (p, f)


def test_a_sibling_whose_name_extends_the_folder_s_is_not_under_it():
    assert not _under("/a/bc/x.py", "/a/b") and not _under("/a/b", "/a/b") and _under("/a/b/x.py", "/a/b")


def test_the_snapshot_lists_a_module_imported_through_a_folder_link_by_its_real_path(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "rk_linked_mod.py").write_text("X = 1\n")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.syspath_prepend(str(tmp_path / "link"))
    import rk_linked_mod  # noqa: F401

    try:
        assert snapshot_files(tmp_path) == [tmp_path.resolve() / "real" / "rk_linked_mod.py"]
        assert snapshot_files(tmp_path / "link") == [tmp_path.resolve() / "real" / "rk_linked_mod.py"]
    finally:
        del sys.modules["rk_linked_mod"]
