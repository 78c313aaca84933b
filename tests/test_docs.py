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


# --- docs/architecture.md's "Where things live" names every module of the package -------------

PACKAGE = REPO / "megatron_ext"
CODE = re.compile(r"`([^`]+)`")


def where_things_live(page: Path) -> tuple[set[str], set[str]]:
    """The module paths (relative to megatron_ext/) of the first column of the page's "Where
    things live" table, and the `tests/...` paths of its last column."""
    text = page.read_text()
    start = text.index("\n## Where things live")
    end = text.find("\n## ", start + 1)
    modules, tests = set(), set()
    for line in text[start : end if end != -1 else len(text)].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or set(cells[0]) <= {"-", " "}:
            continue
        modules |= {c for c in CODE.findall(cells[0]) if c.endswith(".py")}
        tests |= {c for c in CODE.findall(cells[-1]) if c.startswith("tests/")}
    return modules, tests


def package_modules() -> set[str]:
    return {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}


def test_architecture_names_every_module_and_only_real_ones():
    named, tests = where_things_live(REPO / "docs" / "architecture.md")
    actual = package_modules()
    missing = sorted(actual - named)
    assert not missing, (
        "docs/architecture.md's 'Where things live' table does not name these modules of "
        f"megatron_ext/ (add them to a row with their tests): {missing}"
    )
    stale = sorted(named - actual)
    assert not stale, (
        f"docs/architecture.md's 'Where things live' names modules that do not exist: {stale}"
    )
    stale_tests = sorted(t for t in tests if not (REPO / t).exists())
    assert not stale_tests, f"docs/architecture.md names tests that do not exist: {stale_tests}"


def test_the_module_table_check_reads_what_it_must(tmp_path):
    page = tmp_path / "architecture.md"
    page.write_text(
        "# A\n\n## Where things live\n\n| modules | what | tests |\n| --- | --- | --- |\n"
        "| `lev/math.py`, `lev/layer.py` | LEV (`x.py` here is prose) | `tests/lev/`, "
        "`tests/x.py` |\n\n## Next\n\n| `models/builder.py` | not this table | |\n"
    )
    modules, tests = where_things_live(page)
    assert modules == {"lev/math.py", "lev/layer.py"} and tests == {"tests/lev/", "tests/x.py"}
    assert "lev/math.py" in package_modules()


def test_the_reference_pages_stay_within_their_limits():
    """Issue 50: architecture.md at most 250 lines; README.md and docs/*.md together (without
    the generated megatron-compat.md; measurements live in benchmarks/RESULTS.md) at most 3,000.
    Issue 58: benchmarks/RESULTS.md, a reference of each benchmark's latest figures, at most
    800."""

    def lines(path: Path) -> int:
        return len(path.read_text().splitlines())

    assert lines(REPO / "docs" / "architecture.md") <= 250
    pages = [REPO / "README.md"] + [
        p for p in sorted((REPO / "docs").glob("*.md")) if p.name != "megatron-compat.md"
    ]
    assert sum(lines(p) for p in pages) <= 3000
    assert lines(REPO / "benchmarks" / "RESULTS.md") <= 800
