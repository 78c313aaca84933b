"""benchmarks/bench_train_step.py reads LEV's own time per iteration from the timers lines that
the training loop writes (tests/training/test_loop.py checks their format), with --slices
measures only the iterations that no pause interrupted, and with --baseline-tree runs the other
checkout's code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_train_step
from benchmarks.bench_train_step import lev_seconds
from tests.support.jobs import launch


def test_lev_seconds_reads_the_timers_lines_only():
    log = "\n".join(
        [
            "[2026-12-05 14:20:47]  iteration        1/       2 | elapsed time per iteration "
            "(ms): 1278.6 | tokens per second: 3204 | lm loss: 8.5E+00 |",
            "[2026-12-05 14:20:47]     time per iteration (ms): forward-backward: 1265.7 | "
            "grads-all-reduce: 0.1 | grad-norm-and-clip: 5.5 | optimizer: 7.0 | "
            "lev-forward: 14.7 | lev-backward: 23.0",
            "[2026-12-05 14:20:48]  iteration        2/       2 | elapsed time per iteration "
            "(ms): 1100.0 | tokens per second: 3700 | lm loss: 8.4E+00 |",
            "[2026-12-05 14:20:48]     time per iteration (ms): forward-backward: 1090.0 | "
            "grads-all-reduce: 0.1 | grad-norm-and-clip: 5.5 | optimizer: 7.0",
        ]
    )
    seconds = lev_seconds(log)
    assert len(seconds) == 2  # one per timers line; the iteration lines are not counted
    assert abs(seconds[0] - 0.0377) < 1e-12
    assert seconds[1] == 0.0  # a run without LEV spans (TIED)


# A stand-in for pretrain_leviathan.py: --train-iters iterations of 20 ms, each logged to
# --log-jsonl as the training loop does, with its wall-clock start and end added, and with a
# timers line in the output (a run without LEV at --timing-log-level 2).
FAKE_RUN = """
import json, sys, time
argv = sys.argv[1:]
jsonl, iters = argv[argv.index("--log-jsonl") + 1], int(argv[argv.index("--train-iters") + 1])
for i in range(1, iters + 1):
    start = time.time()
    time.sleep(0.02)
    end = time.time()
    with open(jsonl, "a") as f:
        f.write(json.dumps({"iteration": i, "seconds": end - start, "start": start, "end": end}))
        f.write("\\n")
    print(f"    time per iteration (ms): forward-backward: {1000 * (end - start):.1f}", flush=True)
"""


@pytest.mark.integration
def test_turns_measure_no_iteration_that_a_pause_interrupted(tmp_path, monkeypatch):
    """--slices: the runs take turns (SIGSTOP / SIGCONT); no iteration measured spans another
    run's iteration, and after the first turn only the one iteration each pause may have
    interrupted is left out (a pause that lands between two iterations costs the next one)."""
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)

    def start(ranks, flags, args, workdir, tree):
        assert tree is None
        jsonl, log = str(tmp_path / f"{flags[0]}.jsonl"), str(tmp_path / f"{flags[0]}.log")
        argv = ["--log-jsonl", jsonl, "--train-iters", str(args.iters)]
        return launch(script, ranks, argv, log=Path(log), timeout=120), jsonl, log

    monkeypatch.setattr(bench_train_step, "_start", start)
    args = bench_train_step.parse_args(["--iters", "16", "--slices", "3"])
    configs = [("a", 1, ["a"], None), ("b", 1, ["b"], None), ("c", 1, ["c"], None)]
    results = bench_train_step._run_in_turns(configs, args, str(tmp_path))
    records = {
        label: [json.loads(line) for line in (tmp_path / f"{label}.jsonl").read_text().splitlines()]
        for label, _, _, _ in configs
    }
    for label, (times, lev, turns) in results.items():
        assert len(times) == len(turns) == 16 and lev == [0.0] * 16
        assert times == [r["seconds"] for r in records[label]]
        others = [r["end"] for other in records if other != label for r in records[other]]
        first = turns.index(0)  # the first iteration measured
        assert all(t is None for t in turns[:first]) and first >= 2
        measured = [turn for turn in turns if turn is not None]
        assert measured == sorted(measured) and len(measured) >= 16 // 3
        for i, (record, turn) in enumerate(zip(records[label], turns)):
            if turn is not None:
                ends_inside = [e for e in others if record["start"] < e < record["end"]]
                assert not ends_inside, (label, record, turn)  # ran alone, never paused
            elif i > first:  # one per pause: between two turns of this run
                after = turns[i + 1] if i + 1 < len(turns) else turns[i - 1] + 1
                assert turns[i - 1] is not None and after is not None, (label, turns)
                assert after > turns[i - 1], (label, turns)


def test_slices_of_one_iteration_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench_train_step.parse_args(["--slices", "1"])
    assert "--slices 1: give 0" in capsys.readouterr().err


def test_a_run_whose_timers_lines_do_not_match_its_iterations_is_refused(tmp_path):
    """LEV's own time is paired with each iteration's time by position: a run whose output has
    fewer timers lines than --log-jsonl records is an error, not a silent 0."""
    jsonl, log = tmp_path / "m.jsonl", tmp_path / "m.log"
    jsonl.write_text('{"seconds": 1.0}\n{"seconds": 1.1}\n')
    log.write_text("    time per iteration (ms): forward-backward: 990.0 | lev-forward: 10.0\n")
    args = bench_train_step.parse_args([])

    class Finished:  # what _results reads of a Job that exited 0
        def output(self):
            return log.read_text()

    with pytest.raises(RuntimeError, match="2 iterations logged to --log-jsonl but 1 timers"):
        bench_train_step._results(Finished(), 0, str(jsonl), str(log), ["--x"], args)
    log.write_text(log.read_text() * 2)
    times, lev = bench_train_step._results(Finished(), 0, str(jsonl), str(log), ["--x"], args)
    assert times == [1.0, 1.1] and lev == [0.01, 0.01]


@pytest.mark.integration
def test_a_baseline_tree_runs_its_own_entry_and_package(tmp_path):
    """--baseline-tree: a configuration's twin runs that checkout's pretrain_leviathan.py, which
    imports that checkout's megatron_ext, not this one's."""
    tree = tmp_path / "before"
    (tree / "megatron_ext").mkdir(parents=True)
    (tree / "megatron_ext" / "__init__.py").write_text("")
    record = "import megatron_ext, pathlib\n"  # FAKE_RUN's jsonl: where the package came from
    record += "pathlib.Path(jsonl + '.package').write_text(megatron_ext.__file__)\n"
    (tree / "pretrain_leviathan.py").write_text(FAKE_RUN + record)
    args = bench_train_step.parse_args(["--iters", "2", "--baseline-tree", str(tree)])
    times, lev = bench_train_step._run(1, ["--x"], args, str(tmp_path), args.baseline_tree)
    assert len(times) == 2 and lev == [0.0, 0.0]
    (package,) = tmp_path.glob("*.jsonl.package")
    assert Path(package.read_text()).resolve() == (tree / "megatron_ext" / "__init__.py").resolve()
    with pytest.raises(SystemExit):
        bench_train_step.parse_args(["--baseline-tree", str(tmp_path / "nowhere")])
