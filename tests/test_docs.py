"""The docs stand on their own: no path of the machine they were written on, no dead relative
link, every page indexed in docs/README.md."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        REPO / "README.md",
        *REPO.glob("docs/*.md"),
        *REPO.glob("examples/**/*.md"),
        *REPO.glob("benchmarks/*.md"),
    ]
)
# Home and work directories of the machines the docs were written on; outputs are shown with
# paths relative to the repository root, where every documented command runs.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home|Users|private|mnt/data)/[\w.-]+")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_machine_paths(page):
    hits = [
        f"{page.relative_to(REPO)}:{n}: {m.group(0)}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in MACHINE_PATH.finditer(line)
    ]
    assert not hits, "absolute paths of a machine in the docs:\n" + "\n".join(hits)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_exist(page):
    dead = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # URLs, mailto:
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            dead.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            dead.append(target)
    assert not dead, f"{page.relative_to(REPO)} links to missing files or headings: {dead}"


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of `page` (lower case, punctuation dropped,
    spaces as hyphens)."""
    headings = [
        ln.lstrip("#").strip() for ln in page.read_text().splitlines() if ln.startswith("#")
    ]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_page_is_indexed():
    index = (REPO / "docs" / "README.md").read_text()
    linked = set(LINK.findall(index))
    missing = [
        p.name for p in REPO.glob("docs/*.md") if p.name != "README.md" and p.name not in linked
    ]
    assert not missing, f"docs/README.md does not index {missing}"


def test_the_checks_catch_what_they_should(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# 4.1 The `cpu` kernel's speed (2026-12-03)\n")
    assert _anchors(page) == {"41-the-cpu-kernels-speed-2026-12-03"}
    assert MACHINE_PATH.search("loaded /work/wt/eval12/runs/x") is not None
    assert MACHINE_PATH.search("$ /root/.venv/bin/python") is not None
    assert MACHINE_PATH.search("runs/quickstart/work/x and ./work/y and ~/work") is None
