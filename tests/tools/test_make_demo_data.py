"""tools/make_demo_data.py: the docs' demo data (a wikitext file, tiny lm-eval tasks) from a
jsonl corpus; its outputs pinned on a small corpus, bad input as one line and exit code 2 with
nothing left behind, and the script run as the docs run it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zstandard

from tools.make_demo_data import TINY_TASKS, main, wikitext_from_jsonl, write_tiny_tasks

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "make_demo_data.py"

ARTICLES = [
    'The well-known river runs (about 20 km).\nIt floods; crops grow!\n\nA third one, "quoted"?',
    "Second document. It is short.",
]
# The wikitext file of ARTICLES: title = first three words, two paragraphs a section.
WIKITEXT = (
    " \n = The well-known river = \n \n"
    " The well @-@ known river runs ( about 20 km ) . \n"
    " It floods ; crops grow ! \n"
    " = = Section 1 = = \n \n"
    ' A third one , " quoted " ? \n'
    " \n = Second document. It = \n \n"
    " Second document . It is short . \n"
)
SENTENCES = [f"sentence {n} of the corpus has seven words" for n in ("one", "two", "three", "four")]


def _jsonl(path: Path, texts: list[str], compress: bool = False) -> Path:
    data = "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()
    path.write_bytes(zstandard.ZstdCompressor().compress(data) if compress else data)
    return path


def _files(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_wikitext_file_of_the_first_documents(tmp_path):
    corpus = _jsonl(tmp_path / "corpus.jsonl.zst", [*ARTICLES, "A third document."], True)
    out = tmp_path / "wiki" / "wiki.test.tokens"  # the directory is created
    assert wikitext_from_jsonl(str(corpus), str(out), articles=2) == str(out)
    assert out.read_text() == WIKITEXT
    assert _files(tmp_path / "wiki") == ["wiki.test.tokens"]  # no temporary file left


def test_documents_without_text_are_skipped(tmp_path):
    corpus = _jsonl(tmp_path / "c.jsonl", ["", ARTICLES[0], "\n \n", ARTICLES[1]])
    wikitext_from_jsonl(str(corpus), str(tmp_path / "w.tokens"), articles=2)
    assert (tmp_path / "w.tokens").read_text() == WIKITEXT


def test_tiny_tasks(tmp_path):
    # "Too short" (fewer than six words) is not a sentence of the tasks.
    texts = [". ".join(SENTENCES[:2]) + ".", "Too short. " + ". ".join(SENTENCES[2:]) + "."]
    corpus = _jsonl(tmp_path / "c.jsonl", texts)
    out = tmp_path / "tasks"
    assert write_tiny_tasks(str(corpus), str(out), items=2) == str(out)
    assert _files(out) == sorted(f"{t}.{ext}" for t in TINY_TASKS for ext in ("jsonl", "yaml"))

    def rows(task):
        return [json.loads(line) for line in (out / f"{task}.jsonl").read_text().splitlines()]

    one, two, three, four = SENTENCES
    assert rows("tiny_lambada") == [{"text": one}, {"text": two}]
    assert rows("tiny_piqa") == [
        {"goal": "sentence one of the", "sol1": "corpus has seven words",
         "sol2": "corpus has seven words", "label": 0},
        {"goal": "sentence two of the", "sol1": "corpus has seven words",
         "sol2": "corpus has seven words", "label": 0},
    ]  # fmt: skip
    assert rows("tiny_wikitext") == [{"page": f"{one}. {two}."}, {"page": f"{three}. {four}."}]
    assert rows("tiny_gen") == [
        {"question": "sentence one of the corpus has seven", "answer": "words"},
        {"question": "sentence two of the corpus has seven", "answer": "words"},
    ]
    for task in TINY_TASKS:
        yaml = (out / f"{task}.yaml").read_text()
        assert yaml.startswith(f"task: {task}\ndataset_path: json\n")
        assert f"    test: {json.dumps(str((out / f'{task}.jsonl').resolve()))}\n" in yaml


def test_help_describes_every_option_and_default(capsys):
    commands = [("wikitext", "--articles N", 8), ("lm-eval-tasks", "--items N", 6)]
    for command, count, default in commands:
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        text = " ".join(capsys.readouterr().out.split())
        for option in ("--input CORPUS", "--output", count):
            assert option in text
        assert f"(default: {default})" in text
        assert "jsonl corpus" in text


def _bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    good = _jsonl(tmp_path / "good.jsonl", ARTICLES)
    (tmp_path / "not_json.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    (tmp_path / "no_text.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    (tmp_path / "surrogate.jsonl").write_text('{"text": "broken \\ud800 pair"}\n')
    whole = zstandard.ZstdCompressor().compress(b'{"text": "x y z"}\n' * 500)
    (tmp_path / "cut.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "a_file").write_text("")
    out = str(tmp_path / "out")
    return [
        (["wikitext", "--input", str(tmp_path / "missing.jsonl"), "--output", out],
         "cannot open input"),
        (["wikitext", "--input", str(tmp_path / "not_json.jsonl"), "--output", out],
         "not_json.jsonl line 2: not a UTF-8 JSON line"),
        (["lm-eval-tasks", "--input", str(tmp_path / "no_text.jsonl"), "--output", out],
         'no_text.jsonl line 1: expected a JSON object with a "text" string'),
        (["wikitext", "--input", str(tmp_path / "latin1.jsonl"), "--output", out],
         "latin1.jsonl line 1: not a UTF-8 JSON line ('utf-8' codec can't decode byte 0xe9"),
        (["wikitext", "--input", str(tmp_path / "surrogate.jsonl"), "--output", out],
         'surrogate.jsonl line 1: invalid Unicode in "text" (lone surrogate U+D800)'),
        (["wikitext", "--input", str(tmp_path / "cut.jsonl.zst"), "--output", out],
         "cut.jsonl.zst: truncated zstd file"),
        (["wikitext", "--input", str(good), "--output", out, "--articles", "3"],
         "good.jsonl has 2 documents with text, fewer than the 3 articles asked for"),
        (["lm-eval-tasks", "--input", str(good), "--output", out, "--items", "2"],
         "good.jsonl has 2 sentences of six or more words; 2 items per task need 4"),
        (["wikitext", "--input", str(good), "--output", str(tmp_path / "a_file" / "w"),
          "--articles", "2"], "cannot create the directory"),
        (["lm-eval-tasks", "--input", str(good), "--output", str(tmp_path / "a_file"),
          "--items", "1"], "cannot create the directory"),
    ]  # fmt: skip


def test_bad_input_is_one_line_and_exit_2_with_nothing_left(tmp_path, capsys):
    cases = _bad_inputs(tmp_path)
    before = _files(tmp_path)
    for argv, message in cases:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.count("\n") == 1 and captured.err.startswith("error: "), captured.err
        assert message in captured.err, (message, captured.err)
    assert _files(tmp_path) == before  # nothing written, no temporary file


def test_bad_counts_are_refused_by_the_parser(tmp_path, capsys):
    for argv in (["wikitext", "--articles", "0"], ["lm-eval-tasks", "--items", "x"]):
        with pytest.raises(SystemExit) as done:
            main([*argv, "--input", "c.jsonl", "--output", str(tmp_path / "o")])
        assert done.value.code == 2
        assert "expected a positive whole number" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    corpus = _jsonl(tmp_path / "c.jsonl", ARTICLES)
    out = tmp_path / "out"
    out.mkdir()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    assert main(["wikitext", "--input", str(corpus), "--output", str(out / "w.tokens")]) == 2
    assert _files(out) == []


@pytest.mark.integration
def test_the_script_as_the_docs_run_it(tmp_path):
    """`python tools/make_demo_data.py ...` from another directory (the package installed, the
    repository not on the path): both commands, and a bad input's line and exit code."""
    corpus = _jsonl(tmp_path / "corpus.jsonl.zst", [". ".join(SENTENCES) + ".", *ARTICLES], True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def tool(*args):
        return subprocess.run([sys.executable, TOOL, *map(str, args)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    wiki = tool("wikitext", "--input", corpus, "--output", "wiki.test.tokens", "--articles", "3")
    assert wiki.returncode == 0, wiki.stderr
    assert wiki.stdout == "wrote 3 articles to wiki.test.tokens\n"
    assert (tmp_path / "wiki.test.tokens").read_text().endswith(WIKITEXT)
    tasks = tool("lm-eval-tasks", "--input", corpus, "--output", "tasks", "--items", "2")
    assert tasks.returncode == 0, tasks.stderr
    assert len(list((tmp_path / "tasks").glob("*.yaml"))) == len(TINY_TASKS)
    bad = tool("lm-eval-tasks", "--input", corpus, "--output", "more", "--items", "50")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1, bad.stderr
    assert not (tmp_path / "more").exists()
