"""The resumable stage runner: reuse, redo after a change, nothing half-written on failure."""

import json
import re

import pytest

from megatron_ext.quickstart.stages import (
    MARKER,
    Stage,
    StageError,
    compact_iteration_line,
    run_command,
    run_stages,
    short_path,
)


def _stages(calls, key=1, fail_at=None):
    def make(name):
        def run(tmp):
            calls.append(name)
            (tmp / f"{name}.txt").write_text(name)
            if name == fail_at:
                raise RuntimeError("boom")
            return f"{name} done"

        return run

    return [Stage(n, n.upper(), {"k": key if n != "a" else 0}, make(n)) for n in ("a", "b", "c")]


def test_reuse_and_redo_from_the_first_changed_stage(tmp_path, capsys):
    calls = []
    run_stages(_stages(calls), tmp_path)
    assert calls == ["a", "b", "c"]
    assert json.loads((tmp_path / "b" / MARKER).read_text())["summary"] == "b done"
    calls.clear()
    run_stages(_stages(calls), tmp_path)
    assert calls == [] and capsys.readouterr().out.count("reusing the finished stage") == 3
    # b's settings change: b and every later stage are redone, a is reused.
    run_stages(_stages(calls, key=2), tmp_path)
    assert calls == ["b", "c"]


def test_a_failed_stage_leaves_nothing_and_keeps_the_finished_ones(tmp_path):
    calls = []
    with pytest.raises(RuntimeError, match="boom"):
        run_stages(_stages(calls, fail_at="b"), tmp_path)
    assert (tmp_path / "a" / MARKER).is_file()
    assert not (tmp_path / "b").exists() and not (tmp_path / ".b.tmp").exists()
    calls.clear()
    run_stages(_stages(calls), tmp_path)
    assert calls == ["b", "c"]


def test_an_interrupted_stage_is_discarded_and_exits_130(tmp_path):
    def interrupted(tmp):
        (tmp / "half").write_text("x")
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as done:
        run_stages([Stage("x", "X", {}, interrupted)], tmp_path)
    assert done.value.code == 130
    assert list(tmp_path.iterdir()) == []


def test_run_command_failure_shows_the_end_of_its_log(tmp_path):
    log = tmp_path / "cmd.log"
    with pytest.raises(StageError, match=r"exit code 3; end of .*cmd.log:\n.*oops"):
        run_command(["sh", "-c", "echo oops; exit 3"], cwd=tmp_path, log=log)
    run_command(["sh", "-c", "echo shown; echo hidden"], cwd=tmp_path, log=log,
                show=re.compile("shown"))  # fmt: skip
    assert log.read_text() == "shown\nhidden\n"


def test_compact_iteration_line_keeps_the_informative_fields():
    line = (
        " [2026-01-01 00:00:00]  iteration       10/     150 | consumed samples: 160 | "
        "elapsed time per iteration (ms): 512.3 | tokens per second: 4000 | lm loss: 6.5E+00 |"
        " ETA 0:01:00 |"
    )
    out = compact_iteration_line(line)
    assert "consumed samples" not in out
    for part in ("iteration       10/", "elapsed time per iteration", "lm loss", "ETA"):
        assert part in out
    assert compact_iteration_line("validation loss at iteration 10 | x |") == (
        "validation loss at iteration 10 | x"
    )


def test_commands_are_shown_with_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    inside = str(tmp_path / "runs" / "tb")
    assert short_path(inside) == "runs/tb"
    assert short_path(f"tied={inside}") == "tied=runs/tb"
    assert short_path(str(tmp_path / ".venv" / "bin" / "python")) == ".venv/bin/python"
    assert short_path("/elsewhere/x") == "/elsewhere/x"
    assert short_path("--lr") == "--lr"


def test_only_runs_the_named_stages_after_finished_ones(tmp_path):
    """`only` (--stages, how a cluster job array splits the study): the named stages run, the
    earlier ones must be finished, the later ones are left alone."""
    calls = []
    with pytest.raises(StageError, match=r"stage 'a' is not finished .*--stages a"):
        run_stages(_stages(calls), tmp_path, only=["b"])
    assert calls == [] and not (tmp_path / "b").exists()
    run_stages(_stages(calls), tmp_path, only=["a"])
    assert calls == ["a"] and not (tmp_path / "b").exists()
    run_stages(_stages(calls), tmp_path, only=["b"])
    assert calls == ["a", "b"] and (tmp_path / "b" / MARKER).is_file()
    assert not (tmp_path / "c").exists()
    with pytest.raises(StageError, match="stage 'b' is not finished"):  # b's key changed
        run_stages(_stages(calls, key=2), tmp_path, only=["c"])
    assert calls == ["a", "b"] and not (tmp_path / "c").exists()


def test_only_needs_just_the_stages_a_stage_reads(tmp_path):
    """Two training stages that read the same data are independent: one runs without the
    other (`Stage.needs`), as two tasks of a job array."""
    calls = []
    stages = _stages(calls)
    stages[2].needs = ("a",)
    run_stages(stages, tmp_path, only=["a"])
    run_stages(stages, tmp_path, only=["c"])
    assert calls == ["a", "c"] and not (tmp_path / "b").exists()
