"""The documentation cannot rot: the generated reference pages equal what the code generates now (every config key
with a meaning), and every Python block of the README, the home page and the tutorials runs, except blocks marked
``<!-- illustrative -->`` on the line before them (fragments, or what needs several processes or a GPU).

A page's runnable blocks run in order in one fresh process (later blocks use what earlier ones defined), in a
temporary directory, with this checkout's zeroshard: a plain process forked from the test harness's server, which
has imported torch and zeroshard's engine once (``run_distributed(..., join_process_group=False)``), so a page costs
what its code does, not 3 s of imports. The site build itself (``bash scripts/docs.sh``, warnings as errors) runs in
``scripts/test.sh``."""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from zeroshard.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "tutorials").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def runnable_blocks(text: str) -> list[str]:
    """The page's Python blocks not marked illustrative."""
    blocks = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if before.strip() != "<!-- illustrative -->":
            blocks.append(match.group(1))
    return blocks


def test_the_generated_reference_pages_are_current():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "docs_reference.py"), "--check",
                           str(ROOT / "docs" / "reference")], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_config_key_has_a_meaning_and_a_status():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_reference
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    rows = docs_reference.rows()
    assert len(rows) > 200
    assert [r["key"] for r in rows if not r["meaning"]] == []
    assert all(r["status"].split()[0] in ("honoured", "satisfied", "accepted,", "refused") for r in rows)
    meanings = docs_reference.tomllib.loads(docs_reference.MEANINGS.read_text())
    assert sorted(set(meanings) - {r["key"] for r in rows}) == []  # no meaning of a key that is gone


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in PAGES[2:]:
        assert f"tutorials/{page.name}" in nav, page.name


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_the_code_of_the_page_runs(page, tmp_path):
    blocks = runnable_blocks(page.read_text())
    if not blocks:
        pytest.skip(f"{page.name} has no runnable block (all marked illustrative)")
    script = tmp_path / "page.py"
    script.write_text("\n\n".join(blocks))
    env = {"OMP_NUM_THREADS": "1", "ZEROSHARD_DOCS_FIXTURES": str(ROOT / "tests" / "fixtures")}
    run_distributed(run_page, 1, str(script), env=env, timeout_s=600, join_process_group=False)


def run_page(script: str) -> None:
    """``python page.py`` in its directory, this checkout first on the path."""
    os.chdir(os.path.dirname(script))
    sys.path.insert(0, str(ROOT))
    runpy.run_path(script, run_name="__main__")
