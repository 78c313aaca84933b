"""The package works installed, not only from a checkout: `pip install .` (non-editable) into a
fresh virtual environment, then the documented commands run as console scripts and with
`python -m` from a directory outside the checkout, training included.

No download: the fresh environment sees the test environment's site-packages (torch,
megatron-core, ...) through a .pth line, so pip installs only this project (--no-deps,
--no-build-isolation with the setuptools already there). A .pth line adds the directory without
running its own .pth files, so the test environment's editable install of the project stays
invisible.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
# What `pip install .` needs from the checkout (the rest of the tree stays out of the copy).
SOURCES = ["pyproject.toml", "README.md", "pretrain_leviathan.py", "megatron_ext"]


def _run(cmd: list, cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """A fresh venv with the project installed from a copy of the checkout."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    venv = root / "venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    _run([sys.executable, "-m", "venv", "--without-pip", venv], root, env)
    python = venv / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   root, env).stdout.strip()  # fmt: skip
    (Path(purelib) / "_test_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run(
        [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--ignore-installed", "--quiet", src],
        root, env,
    )  # fmt: skip
    shutil.rmtree(src)  # nothing may come from the copy once installed
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    env["OMP_NUM_THREADS"] = "1"
    return dict(python=python, bin=venv / "bin", cwd=elsewhere, env=env, purelib=purelib)


def test_the_package_and_the_entry_are_imported_from_the_install(installed):
    code = "import json, megatron_ext, pretrain_leviathan; print(json.dumps([" \
           "megatron_ext.__file__, pretrain_leviathan.__file__]))"  # fmt: skip
    proc = _run([installed["python"], "-c", code], installed["cwd"], installed["env"])
    for path in json.loads(proc.stdout):
        assert path.startswith(installed["purelib"]), path
        assert not path.startswith(str(ROOT)), path
    # The LEV CPU kernel's C++ source is package data.
    assert (Path(installed["purelib"]) / "megatron_ext/lev/csrc").is_dir()


@pytest.mark.parametrize(
    "command, expected",
    [
        (["leviathan-preprocess-data", "--help"], "--tokenizer-type"),
        (["leviathan-evaluate", "--help"], "perplexity"),
        (["-m", "megatron_ext.evaluation.evaluate", "perplexity", "--help"], "--load"),
        (["-m", "megatron_ext.data.preprocess_data", "--help"], "--output-prefix"),
        (["leviathan-convert-checkpoint", "--help"], "export-hf"),
        (["leviathan-generate", "--help"], "--max-new-tokens"),
        (["leviathan-count-params", "--scales", "200m", "--vocab-sizes", "32000"], "lev"),
        (["leviathan-pretrain", "--help"], "--embedding-type"),
        (["-m", "pretrain_leviathan", "--help"], "--tensor-model-parallel-size"),
        (["leviathan-quickstart", "--help"], "--arms"),
        (["leviathan-gpu-check", "--help"], "--cpu-dry-run"),
    ],
)
def test_documented_commands_run_installed(installed, command, expected):
    if command[0] == "-m":
        cmd = [installed["python"], *command]
    else:
        cmd = [installed["bin"] / command[0], *command[1:]]
    proc = _run(cmd, installed["cwd"], installed["env"])
    assert expected in proc.stdout, proc.stdout[-3000:]


def test_data_path_and_training_run_installed(installed):
    """The quick-start path from the installed package: corpus -> tokenizer -> datasets, then
    two ranks of pretrain_leviathan under torchrun (megatron_ext.testing.runs)."""
    code = """
import json, sys
from pathlib import Path
from megatron_ext.testing.runs import TINY_LEV_MODEL, launch, prepare_sample_data
root = Path(sys.argv[1])
data = prepare_sample_data(root / "corpus", size_mb=0.1)
args = [*TINY_LEV_MODEL, *data, "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "0", "--num-workers", "0",
        "--no-loss-curve", "--log-interval", "1", "--save", str(root / "ckpt")]
run = launch(2, args, root / "run").check()
print(json.dumps(sorted(run.losses)))
"""
    proc = _run([installed["python"], "-c", code, installed["cwd"]], installed["cwd"],
                installed["env"])  # fmt: skip
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [1, 2, 3]
    log = (installed["cwd"] / "run" / "output.log").read_text()
    for checkout_file in (ROOT / "megatron_ext", ROOT / "pretrain_leviathan.py"):
        assert str(checkout_file) not in log  # nothing ran from the checkout
    ckpt = installed["cwd"] / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
