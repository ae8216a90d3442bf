"""The docs site and the README stay what they promise: the API reference teaches exactly ``reprokit.__all__``,
every page is in the navigation, the README stays short, keeps CI's test command and links only pages that exist,
and the quickstart's script is the README's (the README's is run by test_newcomer_readme_walkthrough.py)."""

from __future__ import annotations

import re
from pathlib import Path

import reprokit

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"


def _python_block_after(text: str, heading: str) -> str:
    section = text[text.index(heading):]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, f"no python block under {heading!r}"
    return block.group(1)


def test_the_api_reference_documents_exactly_what_reprokit_exports():
    page = (DOCS / "reference" / "api.md").read_text()
    documented = re.findall(r"^::: reprokit\.(\w+)$", page, flags=re.M)
    assert len(documented) == len(set(documented)), documented
    assert set(documented) | {"__version__"} == set(reprokit.__all__)
    assert "reprokit.__version__" in page


def test_every_page_is_in_the_navigation_and_every_navigation_entry_is_a_page():
    lines = [ln.split("#", 1)[0] for ln in (ROOT / "mkdocs.yml").read_text().splitlines()]  # commented entries out
    in_nav = {m.group(1) for ln in lines if (m := re.search(r":\s+(\S+\.md)\s*$", ln))}
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert in_nav == pages, (sorted(pages - in_nav), sorted(in_nav - pages))


def test_the_readme_is_short_and_keeps_ci_s_test_command():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    full = "OMP_WAIT_POLICY=PASSIVE python -m pytest -q -n 2"
    assert full in text and full in (ROOT / ".ci" / "run").read_text()
    assert 'python -m pytest -m "not slow" -q -n 2' in text


def test_the_readme_links_only_files_that_exist():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", README.read_text())
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing, missing


def test_the_quickstart_script_is_the_readme_s():
    readme = _python_block_after(README.read_text(), "\n## Python API\n")
    quickstart = _python_block_after((DOCS / "quickstart.md").read_text(), "\n## Your own script\n")
    assert quickstart == readme
