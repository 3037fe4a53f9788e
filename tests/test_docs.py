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
