"""The ``pycon`` examples in docs/ run as written (doctest), so the documented semantics cannot drift from the code."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PYCON = re.compile(r"^```pycon\n(.*?)^```", re.S | re.M)


def pycon_files() -> list[Path]:
    return [p for p in sorted(DOCS.glob("*.md")) if PYCON.search(p.read_text())]


@pytest.mark.parametrize("path", pycon_files(), ids=lambda p: p.name)
def test_pycon_examples_run_as_documented(path: Path):
    text = "\n".join(PYCON.findall(path.read_text()))  # one session: later blocks use earlier names
    test = doctest.DocTestParser().get_doctest(text, {}, path.name, str(path), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    failed, attempted = runner.summarize(verbose=False)
    assert attempted > 0 and failed == 0, f"{failed} of {attempted} examples in {path.name} failed (see above)"


ROOT = DOCS.parent
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (but - and _), spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {slug(m) for m in re.findall(r"^#+\s+(.*)$", text, re.M)}


def relative_links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("path", [ROOT / "README.md", *sorted(DOCS.glob("*.md"))], ids=lambda p: p.name)
def test_every_relative_link_resolves(path: Path):
    """Each relative link names a file (or folder) that exists, and an anchor into a Markdown file names one
    of its headings."""
    broken = []
    for target in relative_links(path):
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    assert broken == [], f"{path.name}: broken links {broken}"


def test_code_and_docstrings_name_no_issue_numbers():
    """Code says what holds and why, not which ticket asked for it."""
    pattern = re.compile(r"\bissues? #?\d+", re.I)
    files = [p for folder in ("radixkv", "experiments", "tests", "scripts") for p in (ROOT / folder).rglob("*.py")]
    hits = [f"{p}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []


def test_make_notebooks_opens_the_notebooks_folder_on_loopback():
    """The README sends users to the notebooks: ``make notebooks`` installs JupyterLab (the ``notebooks`` extra)
    and serves notebooks/ on 127.0.0.1 only."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11 and later")
    root = DOCS.parent
    target = re.search(r"^notebooks:.*?(?=^\S|\Z)", (root / "Makefile").read_text(), re.S | re.M).group(0)
    assert '".[notebooks]"' in target and "jupyterlab" in target
    assert "--ip 127.0.0.1" in target and "root_dir=notebooks" in target
    extras = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(dep.startswith("jupyterlab") for dep in extras["notebooks"])
    assert "make notebooks" in (root / "README.md").read_text()
