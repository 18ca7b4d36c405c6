"""Every relative link in the maintained Markdown (README, docs/*.md, CHANGELOG, the folders' READMEs) names a file
or folder that exists, and no test reads a file under docs/ (its fixtures are in tests/fixtures/)."""

import re

import pytest

from conftest import ROOT

PAGES = sorted(
    {ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")}
    | {
        ROOT / p
        for p in ("experiments/README.md", "tools/README.md", "data/captured_batches/README.md", "tests/fixtures/README.md")
    }
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    assert page.exists(), f"{page.relative_to(ROOT)} is missing"
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = (page.parent / target.split("#")[0]).resolve()
        if not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_no_test_reads_docs():
    reads = re.compile(r'ROOT\s*/\s*"docs/')
    for test in (ROOT / "tests").glob("test_*.py"):
        assert not reads.search(test.read_text()), f"{test.name} reads a file under docs/: use tests/fixtures/"
