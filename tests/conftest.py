"""Session-wide test set-up, loaded before any test module (and so before triton is imported).

Two tiers, as Megatron-LM's unit_tests / functional_tests and torchtitan's unit / integration
tests: a module that launches processes (torchrun, spawned gloo ranks, tool subprocesses,
DataLoader workers) or trains declares ``pytestmark = pytest.mark.integration``; everything else
is the unit tier (``bash scripts/test.sh --fast``, which also leaves out the few unit tests
marked ``slow``). The tier is enforced: a test outside the
integration tier that starts a Python process fails and says which marker it is missing.

Without a GPU, Triton kernels run in Triton's CPU interpreter, which must be chosen before
triton is first imported (megatron-core imports it): the LEV Triton tests rely on it.
"""

import collections
import contextlib
import multiprocessing.process
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "integration: launches processes or trains (excluded by `scripts/test.sh --fast`)",
    )
    config.addinivalue_line(
        "markers",
        "slow: a unit test of over half a minute of CPU, or of Triton's CPU interpreter; run by "
        "the full suite, excluded by `scripts/test.sh --fast` and its accelerations-off pass",
    )


def _launches_python(args) -> bool:
    """Whether a Popen argv (list or shell string) starts Python or torchrun."""
    first = os.fsdecode(args if isinstance(args, (str, bytes, os.PathLike)) else args[0])
    program = first.split()[0] if isinstance(args, str) else first
    name = Path(program).name
    return program == sys.executable or name.startswith("python") or name == "torchrun"


@contextlib.contextmanager
def _no_launches(where: str):
    """Make starting a Python process or a multiprocessing child fail, naming the test.

    Compilers and other non-Python helpers (the C++ LEV kernel's build, ``git`` for the run
    metadata) stay allowed: they are part of what a unit under test does, not a launched run.
    """

    def refuse(what: str):
        raise AssertionError(
            f"{where} {what}: it belongs to the integration tier; add "
            "`pytestmark = pytest.mark.integration` to its module"
        )

    popen_init = subprocess.Popen.__init__
    start = multiprocessing.process.BaseProcess.start

    def guarded_popen(self, args, *a, **kw):
        if _launches_python(args):
            refuse(f"launches a Python process ({args!r:.120})")
        popen_init(self, args, *a, **kw)

    def guarded_start(self):
        refuse(f"starts a multiprocessing child ({type(self).__name__})")

    subprocess.Popen.__init__ = guarded_popen
    multiprocessing.process.BaseProcess.start = guarded_start
    try:
        yield
    finally:
        subprocess.Popen.__init__ = popen_init
        multiprocessing.process.BaseProcess.start = start


def _guarded(item):
    if item.get_closest_marker("integration") is not None:
        return contextlib.nullcontext()
    return _no_launches(item.nodeid)


# Setup is wrapped too: a session fixture that builds a corpus with the tools is set up while
# the first test that asks for it sets up.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        yield


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory) -> list[str]:
    """Data + tokenizer flags of one generated corpus for the whole session (about 150k tokens,
    SentencePiece vocab 512; tests.support.runs.prepare_sample_data), shared by the
    training runs and the `trained` checkpoints (built once, also across xdist workers)."""
    from tests.support.once import build_once, session_dir
    from tests.support.runs import prepare_sample_data

    flags = build_once(session_dir(tmp_path_factory), "sample_data", prepare_sample_data)
    # Megatron writes its dataset index caches unlocked: one cache directory per worker.
    flags[flags.index("--data-cache-path") + 1] = str(tmp_path_factory.mktemp("data_cache"))
    return flags


@pytest.fixture(scope="session")
def trained(tmp_path_factory, sample_data) -> dict:
    """Every arm trained by `pretrain_leviathan.py` on `sample_data` (TRAINED_ARMS), with
    grouped-query attention (it exercises every converter's QKV group mapping): built once per
    session, also across xdist workers, and shared by the conversion and evaluation tests, which
    only read it. {"data": data flags, "corpus": the corpus directory (raw/, tok.model,
    sample_text_document.*), "tokenizer": tok.model, "ckpt" / "tensorboard" / "jsonl":
    {arm: path}}; tests.support.runs.trained_run_flags gives an arm's ranks and flags."""
    from tests.support.once import build_once, session_dir

    def build(root: Path) -> dict:
        return _train_arms(root, sample_data)

    return {**build_once(session_dir(tmp_path_factory), "trained", build), "data": sample_data}


def _train_arms(root: Path, data: list[str]) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    from tests.support.runs import TRAINED_ARMS, train, trained_run_flags

    def one(arm: str) -> None:
        nproc, flags = trained_run_flags(arm, data)
        run = root / arm
        logs = ["--save", str(run / "ckpt"), "--tensorboard-dir", str(run / "tb")]
        train(nproc, [*flags, *logs], run).check()

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(one, TRAINED_ARMS))
    tokenizer = data[data.index("--tokenizer-model") + 1]
    return {
        "corpus": str(Path(tokenizer).parent),
        "tokenizer": tokenizer,
        "ckpt": {arm: str(root / arm / "ckpt") for arm in TRAINED_ARMS},
        "tensorboard": {arm: str(root / arm / "tb") for arm in TRAINED_ARMS},
        "jsonl": {arm: str(root / arm / "metrics.jsonl") for arm in TRAINED_ARMS},
    }


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory) -> dict:
    """`tools/quickstart.py --out OUT` with tests.support.runs.QUICKSTART_FLAGS, run once per
    session (also across xdist workers) and only read by its users: {"out": OUT, "stdout": what
    it printed}. tests/scripts/test_quickstart.py checks it; tests/test_docs_commands.py starts
    the docs' workspace with a copy of it, so that README.md's `bash scripts/quickstart.sh` with
    the same flags finds every stage finished, as a second run of a user's does."""
    from tests.support.once import build_once, session_dir
    from tests.support.runs import QUICKSTART_FLAGS

    def build(root: Path) -> dict:
        out = root / "run"
        repo = Path(__file__).resolve().parents[1]
        proc = subprocess.run(
            [sys.executable, str(repo / "tools" / "quickstart.py"), "--out", str(out),
             *QUICKSTART_FLAGS],
            cwd=repo, env=dict(os.environ, PYTHONPATH=str(repo)), capture_output=True,
            text=True, timeout=1200,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        return {"out": str(out), "stdout": proc.stdout}

    return build_once(session_dir(tmp_path_factory), "quickstart", build)


# The docs test's pages (tests/test_docs_commands.py), each a unit of work of its own: under
# `--dist loadfile` (pyproject.toml) a module's tests go to one xdist worker, and the docs
# module's pages, a third of the suite's time, would run one after another on one worker.
ONE_TEST_PER_UNIT = ("tests/test_docs_commands.py::test_documented_commands_run[",)
_DOCS = "tests/test_docs_commands.py::test_documented_commands_run[{}]".format

# The order in which the xdist workers are handed units of work (pyproject.toml turns off
# xdist's own order, most tests first, which left the long few-test integration units to the
# end, one worker running them while the other had nothing left): the longest first (the
# integration modules below in the order of their CPU seconds), those that build a session
# fixture (`trained`, `quickstart_run`) a while before those that wait for it, then the other
# integration modules, then the unit modules (most tests first), which fill in at the end. A
# worker is handed its next unit once two or fewer of its tests are left to run, so a worker
# running a one-test unit (a page) already holds the next.
RUN_FIRST = (
    "tests/scripts/test_quickstart.py",  # builds `quickstart_run`
    _DOCS("docs/evaluation.md"),  # makes and evaluates its own two runs: the longest page
    "tests/conversion/test_convert.py",  # builds `trained`
    _DOCS("docs/cluster.md"),  # its own corpus and runs, and waits on the wall clock
    _DOCS("docs/convert.md"),  # on a copy of `quickstart_run`
    _DOCS("README.md"),  # on a copy of `quickstart_run`
    "tests/slurm/test_sbatch.py",  # Slurm jobs, mostly waiting on time limits: about 4 min
    "tests/slurm/test_study.py",  # the study as a job array, then its report again: 2-3 min
    "tests/training/test_resume_exact.py",  # five layouts, each trained and resumed
    "tests/training/test_end_to_end.py",
    "tests/benchmarks/test_scale_1p2b.py",  # every stage of the 1.2B recipe on o200k
    "tests/tools/test_megatron_lm_workflow.py",
    "tests/training/test_cluster_nodes.py",
    "tests/training/test_pipeline.py",
    "tests/checkpoint/test_digests.py",
    "tests/training/test_signals.py",
    "tests/training/test_megatron_recipes.py",
    "tests/training/test_cluster.py",
    "tests/training/test_failed_launch.py",
    "tests/training/test_resume_checks.py",
)


def _module(item) -> str:
    return item.nodeid.split("::")[0]


def _run_first(nodeid: str) -> int:
    """The index of `nodeid`'s module or test in RUN_FIRST, else len(RUN_FIRST)."""
    for i, entry in enumerate(RUN_FIRST):
        if nodeid == entry or nodeid.startswith(entry + "::"):
            return i
    return len(RUN_FIRST)


def pytest_collection_modifyitems(config, items):
    counts = collections.Counter(_module(item) for item in items)

    def rank(indexed) -> tuple:
        index, item = indexed
        first = _run_first(item.nodeid)
        if first < len(RUN_FIRST):
            return (0, first, index)
        if item.get_closest_marker("integration") is not None:
            return (1, 0, index)
        return (2, -counts[_module(item)], index)

    items[:] = [item for _, item in sorted(enumerate(items), key=rank)]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with the tests of ONE_TEST_PER_UNIT handed out one by one."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(ONE_TEST_PER_UNIT):
                return nodeid
            return super()._split_scope(nodeid)

    return Scheduling(config, log)
