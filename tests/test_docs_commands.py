"""The commands the docs show run as shown: every command block of README.md, docs/*.md and
examples/*.md runs, in reading order, in one scratch workspace laid out like the repository, and
must exit as the page says and leave the files it promises.

A page marks each block that shows commands (a ```bash fence, or `$ ` lines in a transcript)
with an HTML comment on the line before it, which GitHub does not render:

    <!-- docs-test: {"sub": [["--vocab-size 200000", "--vocab-size 2000"]],
                     "creates": ["data/tok.model"]} -->
    <!-- docs-test: {"skip": "needs 8 GPUs"} -->

- `sub`: pairs (shown, run) that shrink sizes to CPU scale (iterations, widths, vocabulary,
  corpus size, processes); the command itself is never substituted. Each pair must occur in the
  block.
- `creates`: paths (relative to the repository root) that must exist after the block.
- `exit`: the exit status of the block's last command (0 by default; every earlier command must
  exit 0), or a list with one status per command run. Transcripts show a non-zero status as a
  line `(exit status N)`.
- `expect`: text the output of the block's last command must contain (an error message shown
  on the page, so that a block that fails for another reason does not pass on its exit code).
  A number with a decimal point in it (`lm loss: 6.258275E+00`) matches the output's number to
  a relative 1e-5 or one unit of its last digit: the page shows what one machine printed, and
  another CPU's or BLAS's float32 rounding moves the last digits (6.258276E+00 on an AMD EPYC).
- `skip`: why the block cannot run here (a GPU, a cluster, a download, the test suite itself);
  or {"command prefix": "why"} to leave out only the commands that start so.
- `env`: variables to set, e.g. {"F": "--mock-data ..."} where the page defines them in prose.

A variable a block assigns on a line of its own (`D=runs/eval_demo`) holds for the rest of the
page, as it would in the reader's shell. A command that is only `python SCRIPT ...`,
`python -m MODULE ...` or torchrun with no option but --standalone and --nproc-per-node (no
shell syntax besides variables and quotes) has its words expanded by bash and runs in
processes forked from the tests' preloaded server (tests.support.runs.run_command, with
torchrun's worker environment and exit status 1 for a failed rank): the same entry, arguments,
directory and environment without importing torch and megatron-core again, about 2.5 s of CPU
a process; every other command runs in bash. A command block without a marker, and a command shown
as an indented code block (which a reader copies as readily but no fence marks), fail the unit
tests below, so a new command cannot go untested by accident.

The runs are the integration tier, one test per page, each page's blocks in reading order in a
workspace of its own, so that pytest-xdist runs pages on different workers (tests/conftest.py
hands each page out on its own, the longest first); the workspace's data/ and runs/ are a
temporary directory, never the checkout's. What a page uses from an earlier page is made once
per session and copied in (FROM_QUICKSTART): runs/quickstart, the session's quick-start run
(README.md's command with the same flags), for the page that reads the quick start's
checkpoint and data (docs/convert.md), and for README.md and docs/quickstart.md, whose quick
start then runs as a second run of a user's does: every stage found finished.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from tests.support.runs import QUICKSTART_FLAGS, run_command

REPO = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- docs-test: (.*) -->$")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
EXIT_LINE = re.compile(r"^\(exit status (\d+)\)$")
ASSIGNMENT = re.compile(r"""^[A-Za-z_]\w*=("[^"]*"|'[^']*'|[^\s;&|]*)$""")
# Lines that open / close a compound command, whose lines run as one command.
OPENS = re.compile(r"^(for|while|until|if)\b")
CLOSES = re.compile(r"^(done|fi)\b")
# The first word of a line that shows a command, for commands hidden in indented code blocks.
COMMAND_WORD = re.compile(r"^(\$ )?(python|python3|torchrun|bash|sbatch|srun|docker|pip)\s")
# Pages in the order a newcomer reads them (the order of the test ids).
PAGE_ORDER = [
    "README.md",
    "docs/data.md",
    "docs/quickstart.md",
    "docs/lev.md",
    "docs/lev-training.md",
    "docs/evaluation.md",
    "docs/convert.md",
    "docs/cluster.md",
    "docs/gpu.md",
    "docs/design.md",
    "docs/architecture.md",
    "examples/README.md",
]
# The pages that start from what README.md's quick start made (runs/quickstart): a copy of the
# session's quick-start run (tests/conftest.py quickstart_run). Every other page makes its inputs.
FROM_QUICKSTART = ("README.md", "docs/quickstart.md", "docs/convert.md")
MARKER_KEYS = {"sub", "creates", "exit", "expect", "skip", "env"}
# A number an `expect` text shows, compared to a tolerance (the module's docstring).
NUMBER = re.compile(r"[-+]?\d+\.\d+(?:[eE][-+]?\d+)?")
# Shell syntax that keeps a command in bash (anything but words, quotes and variables).
SHELL_SYNTAX = re.compile(r"[|&;<>()`\\\n]|\$\(")


@dataclass
class Block:
    """One command block: its commands (continuations joined, a compound command as one) and
    what its marker says."""

    page: str
    line: int
    commands: list[str]
    options: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        """`page:line` of the block's opening fence."""
        return f"{self.page}:{self.line}"


def _commands(lang: str, body: list[str]) -> tuple[list[str], Optional[int]]:
    """The commands of a fenced block and the exit status its transcript shows (None: 0).

    In a transcript, a command is a line that starts with `$ ` (not indented: indented `$ `
    lines are a tool's output echoing what it ran) and the lines its trailing `\\` continues.
    """
    transcript = any(ln.startswith("$ ") for ln in body)
    if not transcript and lang not in ("bash", "sh", "shell", "console"):
        return [], None
    commands, current, status, depth, continued = [], None, None, 0, False
    for raw in body:
        text = raw.strip()
        if current is None:
            if transcript:
                if EXIT_LINE.match(text):
                    status = int(EXIT_LINE.match(text).group(1))
                if not raw.startswith("$ "):
                    continue
                text = text[2:]
            elif not text or text.startswith("#"):
                continue
            current = text
        elif text or continued:
            current += (" " if continued else "\n") + text
        continued = text.endswith("\\")
        if continued:
            current = current[:-1].rstrip()
            continue
        line = text.split(" #")[0].strip()
        if OPENS.match(line) and not re.search(r"\b(done|fi)\b", line):
            depth += 1
        elif CLOSES.match(line):
            depth -= 1
        if depth > 0:
            continue
        commands.append(current)
        current = None
    return commands, status


def command_blocks(page: Path) -> list[tuple[Block, bool]]:
    """Every fenced block of `page` that shows commands, with whether it is marked."""
    lines = page.read_text().splitlines()
    out, marker, i = [], None, 0
    rel = page.relative_to(REPO).as_posix()
    while i < len(lines):
        fence = FENCE.match(lines[i])
        found = MARKER.match(lines[i].strip())
        if found:
            marker = json.loads(found.group(1))
            unknown = set(marker) - MARKER_KEYS
            assert not unknown, f"{rel}:{i + 1}: unknown docs-test keys {sorted(unknown)}"
            i += 1
            continue
        if fence:
            start, lang, body = i, fence.group(2), []
            i += 1
            while i < len(lines) and not FENCE.match(lines[i]):
                body.append(lines[i])
                i += 1
            commands, status = _commands(lang, body)
            if commands:
                options = dict(marker or {})
                if status is not None:
                    options.setdefault("exit", status)
                out.append((Block(rel, start + 1, commands, options), marker is not None))
            marker = None
        elif lines[i].strip():
            marker = None  # a marker belongs to the block right below it
        i += 1
    return out


def indented_commands(page: Path) -> list[str]:
    """`page:line` of commands shown in indented code blocks (four spaces after a blank line,
    outside fences), which no marker can name: fence them as ```bash."""
    hits, in_fence, in_block, prev_blank = [], False, False, True
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            indented = line.startswith("    ") or line.startswith("\t")
            in_block = indented and (in_block or prev_blank)
            if in_block and COMMAND_WORD.match(line.strip()):
                hits.append(f"{page.relative_to(REPO).as_posix()}:{n}: {line.strip()[:80]}")
        prev_blank = not line.strip()
    return hits


def _pages() -> list[Path]:
    found = {p.relative_to(REPO).as_posix() for p in [REPO / "README.md", *REPO.glob("docs/*.md")]}
    found |= {p.relative_to(REPO).as_posix() for p in REPO.glob("examples/**/*.md")}
    ordered = [p for p in PAGE_ORDER if p in found]
    return [REPO / p for p in ordered + sorted(found - set(ordered))]


def _substituted(block: Block) -> list[str]:
    commands = list(block.commands)
    for shown, run in block.options.get("sub", []):
        hits = [i for i, c in enumerate(commands) if shown in c]
        assert hits, f"{block.where}: substitution {shown!r} matches no command"
        for i in hits:
            commands[i] = commands[i].replace(shown, run)
    return commands


def test_every_command_block_is_marked():
    unmarked = [
        f"{b.where}: {b.commands[0][:80]}"
        for page in _pages()
        for b, marked in command_blocks(page)
        if not marked
    ]
    assert not unmarked, (
        "command blocks without a <!-- docs-test: ... --> marker (run them here, or say why "
        "not with skip):\n" + "\n".join(unmarked)
    )


def test_no_command_in_an_indented_block():
    hits = [hit for page in _pages() for hit in indented_commands(page)]
    assert not hits, "commands in indented code blocks (fence them as ```bash):\n" + "\n".join(hits)


def test_every_substitution_matches_its_block():
    for page in _pages():
        for block, _ in command_blocks(page):
            _substituted(block)


def test_the_parser_reads_bash_blocks_and_transcripts(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    page = tmp_path / "page.md"
    page.write_text(
        '<!-- docs-test: {"creates": ["a"]} -->\n'
        "```bash\n# comment\nD=runs/x\npython x.py --a 1 \\\n    --b 2\n"
        "for s in a b; do\n    echo $s \\\n        $D\ndone\nls\n```\n\n"
        "```text\n$ python y.py \\\n    --c 3\nsome output\n  $ python echoed.py\n"
        "(exit status 2)\n```\n"
        "```\nno commands here\n```\n\n"
        "    python indented.py\n"
    )
    (first, marked), (second, unmarked) = command_blocks(page)
    assert marked and first.commands == [
        "D=runs/x",
        "python x.py --a 1 --b 2",
        "for s in a b; do\necho $s $D\ndone",
        "ls",
    ]
    assert first.options == {"creates": ["a"]} and first.line == 2
    assert not unmarked and second.commands == ["python y.py --c 3"]
    assert second.options == {"exit": 2}
    assert indented_commands(page) == ["page.md:25: python indented.py"]


def test_simple_python_commands_are_recognised():
    """The commands that run forked from the preloaded server, as (entry, ranks, argv,
    torchrun); any other option or program runs in bash."""
    assert _python_entry(["python", "tools/x.py", "--a", "1"]) == (
        "tools/x.py",
        1,
        ["--a", "1"],
        False,
    )
    assert _python_entry(["python", "-m", "pkg.mod", "-v"]) == ("pkg.mod", 1, ["-v"], False)
    run = ["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert _python_entry([*run, "t.py", "--b"]) == ("t.py", 2, ["--b"], True)
    assert _python_entry(["torchrun", "--nproc_per_node=4", "-m", "m", "x"]) == (
        "m",
        4,
        ["x"],
        True,
    )
    assert _python_entry(["torchrun", "t.py"]) == ("t.py", 1, [], True)
    for other in (["python", "-c", "print(1)"], ["torchrun", "--nnodes", "2", "t.py"],
                  ["bash", "x.sh"], ["python"], [*run]):  # fmt: skip
        assert _python_entry(other) is None, other
    assert SHELL_SYNTAX.search("python x.py > out") and SHELL_SYNTAX.search("a && b")
    assert not SHELL_SYNTAX.search('python x.py --p "The river" $D/ckpt')


def _close(shown: str, printed: str) -> bool:
    """Whether `printed` is `shown` to a relative 1e-5 or one unit of `shown`'s last digit."""
    mantissa, _, exponent = shown.lower().partition("e")
    unit = 10.0 ** (int(exponent or 0) - len(mantissa.split(".")[1]))
    a, b = float(shown), float(printed)
    return abs(a - b) <= max(1e-5 * abs(a), unit * (1 + 1e-9))


def expected_in(text: str, output: str) -> bool:
    """Whether `output` holds `text`, its numbers with a decimal point to a tolerance."""
    shown = NUMBER.findall(text)
    if not shown:
        return text in output
    pieces = NUMBER.split(text)
    pattern = f"({NUMBER.pattern})".join(re.escape(p) for p in pieces)
    for found in re.finditer(pattern, output):
        printed = [found.group(i + 1) for i in range(len(shown))]
        if all(_close(a, b) for a, b in zip(shown, printed)):
            return True
    return False


def test_expected_numbers_match_to_a_tolerance():
    out = "iteration 2 | lm loss: 6.258276E+00 | std 0.0201 | 1,234.1M\n"
    assert expected_in("lm loss: 6.258275E+00", out)  # another CPU's last digit
    assert expected_in("std 0.0200 |", out) and expected_in("1,234.1M", out)
    assert expected_in("iteration 2 |", out) and expected_in("loss: 6.3E+00 |", out)
    assert not expected_in("lm loss: 6.258375E+00", out)  # 1.6e-5 off
    assert not expected_in("std 0.0203 |", out) and not expected_in("iteration 3 |", out)
    assert not expected_in("1,234.3M", out) and not expected_in("lm loss: 6.1E+00", out)


def _workspace(tmp: Path) -> Path:
    """A directory laid out like the repository (its top-level entries linked), in which the
    documented commands write data/, runs/ and the like without touching the checkout."""
    work = tmp / "repo"
    work.mkdir()
    for entry in REPO.iterdir():
        if entry.name in ("data", "runs") or entry.name.startswith("."):
            continue
        (work / entry.name).symlink_to(entry)
    return work


def _checkout_state() -> tuple[list[str], str]:
    """The checkout's top-level entries and `git status` (what a command could leave there)."""
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"],
        cwd=REPO,
        capture_output=True,
        text=True,
    ).stdout
    return sorted(p.name for p in REPO.iterdir()), status


def _page_workspace(tmp: Path, page: str, request) -> Path:
    """The workspace of one page; runs/quickstart a copy of the session's quick-start run for
    the pages that start from it (asked for only there: the other pages do not wait for it)."""
    work = _workspace(tmp)
    if page in FROM_QUICKSTART:
        quickstart = request.getfixturevalue("quickstart_run")["out"]
        shutil.copytree(quickstart, work / "runs" / "quickstart")
    return work


def test_readme_runs_the_sessions_quick_start():
    """The copy of the session's quick start is what README.md's command makes (same flags)."""
    readme = [b for b, _ in command_blocks(REPO / "README.md")]
    shown = [c for b in readme for c in _substituted(b) if c.startswith("bash scripts/quickstart")]
    assert shown and all(
        c.split("#")[0].split() == ["bash", "scripts/quickstart.sh", *QUICKSTART_FLAGS]
        for c in shown
    ), shown


def _environment(block: Block) -> dict:
    venv = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{venv}{os.pathsep}{os.environ.get('PATH', '')}",
        # scripts/setup.sh reuses this environment instead of making one in the workspace.
        "VENV": str(venv.parent),
        "PYTHONPATH": str(REPO),
    }
    env.update(block.options.get("env", {}))
    return env


def _python_entry(words: list[str]) -> Optional[tuple[str, int, list[str], bool]]:
    """(entry, ranks, argv, torchrun) of `python SCRIPT|-m MODULE ...` or of torchrun with no
    option but --standalone and --nproc-per-node; None for any other command."""
    python = words[:1] in (["python"], ["python3"])
    if python and words[1:3] == ["-m", "torch.distributed.run"]:
        words, python = ["torchrun", *words[3:]], False
    if python:
        if words[1:2] == ["-m"] and len(words) > 2:
            return words[2], 1, words[3:], False
        if len(words) > 1 and not words[1].startswith("-"):
            return words[1], 1, words[2:], False
        return None
    if words[:1] != ["torchrun"]:
        return None
    nproc, rest = 1, words[1:]
    while rest and rest[0].startswith("--"):
        option, _, value = rest.pop(0).replace("_", "-").partition("=")
        if option == "--nproc-per-node" and (value or rest):
            nproc = int(value or rest.pop(0))
        elif option != "--standalone":
            return None
    if rest[:1] == ["-m"]:
        rest = rest[1:]
    return (rest[0], nproc, rest[1:], True) if rest else None


def _run_command(command: str, cwd: Path, variables: list[str], env: dict) -> tuple[int, str]:
    """Run one command after the page's assignments; (exit status, stdout and stderr)."""
    entry, prefix = None, {}
    if not SHELL_SYNTAX.search(command):
        words = subprocess.run(
            ["bash", "-c", "\n".join([*variables, f"set -- {command}", 'printf "%s\\0" "$@"'])],
            cwd=cwd, env=env, capture_output=True, text=True, check=True,
        ).stdout.split("\0")[:-1]  # fmt: skip
        while words and re.match(r"^[A-Za-z_]\w*=", words[0]):  # NAME=value python ...
            key, _, value = words.pop(0).partition("=")
            prefix[key] = value
        entry = _python_entry(words)
    if entry is None:
        proc = subprocess.run(
            ["bash", "-c", "\n".join([*variables, command])], cwd=cwd, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900,
        )  # fmt: skip
        return proc.returncode, proc.stdout
    script, nproc, argv, torchrun = entry
    run = run_command(script, argv, cwd, nproc=nproc, merge_stderr=True, env={**env, **prefix},
                      timeout=900, torchrun=torchrun)  # fmt: skip
    return (1 if torchrun and run.returncode else run.returncode), run.stdout


def _run_block(block: Block, cwd: Path, variables: list[str]) -> None:
    """Run a block's commands one by one (after the page's earlier assignments), check their
    exit statuses, the last one's output and the files the block promises."""
    skipped = block.options.get("skip", {})
    commands = [c for c in _substituted(block) if not any(c.startswith(s) for s in skipped)]
    assert len(commands) + len(skipped) == len(block.commands), f"{block.where}: skip {skipped}"
    want = block.options.get("exit", 0)
    if not isinstance(want, list):
        want = [0] * (len(commands) - 1) + [want]
    assert len(want) == len(commands), f"{block.where}: {len(want)} exit statuses"
    for command, expected in zip(commands, want):
        started = time.monotonic()
        returncode, output = _run_command(command, cwd, variables, _environment(block))
        print(f"{block.where}: {time.monotonic() - started:5.1f} s  {command[:90]}")
        assert returncode == expected, (
            f"{block.where}: `{command[:300]}` exited {returncode}, the page says "
            f"{expected}; its output ended with:\n{output[-3000:]}"
        )
        if ASSIGNMENT.match(command):
            variables.append(command)
    missing = [p for p in block.options.get("expect", []) if not expected_in(p, output)]
    assert not missing, (
        f"{block.where}: the output lacks {missing}; it ended with:\n{output[-3000:]}"
    )
    missing = [p for p in block.options.get("creates", []) if not (cwd / p).exists()]
    assert not missing, f"{block.where}: the page promises {missing}, which do not exist"


@pytest.mark.integration
@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_documented_commands_run(page, tmp_path, request):
    blocks = [
        b
        for b, marked in command_blocks(page)
        if marked and not isinstance(b.options.get("skip"), str)
    ]
    before = _checkout_state()
    workspace = _page_workspace(tmp_path, page.relative_to(REPO).as_posix(), request)
    variables: list[str] = []
    for block in blocks:
        _run_block(block, workspace, variables)
    assert _checkout_state() == before, "a documented command wrote into the checkout"
