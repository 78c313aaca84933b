"""The package works installed, not only from a checkout, and holds only the product.

The wheel is built once (`pip wheel`) from a copy of the checkout. Its modules are checked
against what the product's entry points reach: nothing only tests, benchmarks or doc demos use
may ship in it. Then it is installed (non-editable) into a fresh virtual environment and the
documented commands run as console scripts and with `python -m` from a directory outside the
checkout, training included.

No download: the fresh environment sees the test environment's site-packages (torch,
megatron-core, ...) through a .pth line, so pip installs only this project (--no-deps,
--no-build-isolation with the setuptools already there). A .pth line adds the directory without
running its own .pth files, so the test environment's editable install of the project stays
invisible.
"""

from __future__ import annotations

import ast
import configparser
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]
# What `pip wheel .` needs from the checkout (the rest of the tree stays out of the copy).
SOURCES = ["pyproject.toml", "README.md", "pretrain_leviathan.py", "megatron_ext"]
# Names of test-only code: no module of the wheel may carry one as a package or module name.
TEST_ONLY_NAMES = {"test", "tests", "testing", "support", "conftest"}
# Package modules that maintainers run with `python -m` to regenerate a docs page (entry points
# beside the users' ones): {module: the page}.
DOC_GENERATORS = {"megatron_ext.training.compat_doc": "docs/megatron-compat.md"}


def _run(cmd: list, cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The project's wheel, built from a copy of the checkout."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "--quiet", "--wheel-dir", root / "dist", src],
        root, _clean_env(),
    )  # fmt: skip
    (built,) = (root / "dist").glob("*.whl")
    return built


@pytest.fixture(scope="module")
def installed(tmp_path_factory, wheel) -> dict:
    """A fresh venv with the wheel installed."""
    root = tmp_path_factory.mktemp("install")
    venv = root / "venv"
    env = _clean_env()
    _run([sys.executable, "-m", "venv", "--without-pip", venv], root, env)
    python = venv / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   root, env).stdout.strip()  # fmt: skip
    (Path(purelib) / "_test_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run(
        [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--ignore-installed", "--quiet", wheel],
        root, env,
    )  # fmt: skip
    elsewhere = root / "elsewhere"
    elsewhere.mkdir()
    env["OMP_NUM_THREADS"] = "1"
    return dict(python=python, bin=venv / "bin", cwd=elsewhere, env=env, purelib=purelib)


# ----------------------------------------------------------------------------- the wheel's modules


def wheel_modules(wheel: Path) -> dict[str, tuple[str, bool]]:
    """{dotted name: (source, is_package)} of every Python module in ``wheel``."""
    with zipfile.ZipFile(wheel) as archive:
        return {
            _module_name(path): (archive.read(path).decode(), path.endswith("/__init__.py"))
            for path in archive.namelist()
            if path.endswith(".py")
        }


def _module_name(path: str) -> str:
    """``megatron_ext/lev/__init__.py`` -> ``megatron_ext.lev``; ``a/b.py`` -> ``a.b``."""
    parts = path[: -len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _referenced_names(source: str, module: str, is_package: bool) -> set[str]:
    """Dotted names a module's source refers to as modules: its imports (absolute and relative,
    deferred ones inside functions included; ``from P import x`` yields ``P`` and ``P.x``) and
    every string constant, so that the lazy-export tables (megatron_ext/_lazy.py), the
    ``importlib.import_module("...")`` strings and ``python -m ...`` command lines count. A
    package that imports its submodules by a computed name (``importlib.import_module(
    f"{__name__}.{name}")``, as megatron_ext/cpu_accel does) also refers to each submodule whose
    bare name it holds as a string."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    computed_submodules = False
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)
        elif isinstance(node, ast.JoinedStr) and len(node.values) >= 2:
            first, second = node.values[:2]
            computed_submodules |= (
                is_package
                and isinstance(first, ast.FormattedValue)
                and isinstance(first.value, ast.Name)
                and first.value.id == "__name__"
                and isinstance(second, ast.Constant)
                and second.value == "."
            )
    if computed_submodules:
        names |= {f"{module}.{name}" for name in names if name.isidentifier()}
    return names


def reachable_modules(modules: dict[str, tuple[str, bool]], entries: list[str]) -> set[str]:
    """The names of ``modules`` (as `wheel_modules` gives them) that ``entries`` reach: each
    entry is the dotted name of a module or the source of an entry script; importing a module
    imports its parent packages."""
    found: set[str] = set()
    todo: list[str] = []

    def reach(names: set[str]) -> None:
        for name in names:
            parts = name.split(".")
            for end in range(1, len(parts) + 1):
                prefix = ".".join(parts[:end])
                if prefix in modules and prefix not in found:
                    found.add(prefix)
                    todo.append(prefix)

    for entry in entries:
        reach({entry} if entry in modules else _referenced_names(entry, "__main__", False))
    while todo:
        name = todo.pop()
        source, is_package = modules[name]
        reach(_referenced_names(source, name, is_package))
    return found


def product_entries(wheel: Path) -> list[str]:
    """What a user runs: the console scripts the wheel installs (their modules), the training
    entry and the checkout's tools/*.py scripts (their sources); and the DOC_GENERATORS."""
    with zipfile.ZipFile(wheel) as archive:
        (path,) = [p for p in archive.namelist() if p.endswith(".dist-info/entry_points.txt")]
        parser = configparser.ConfigParser()
        parser.read_string(archive.read(path).decode())
    scripts = [target.split(":")[0].strip() for target in parser["console_scripts"].values()]
    tools = [path.read_text() for path in sorted((ROOT / "tools").glob("*.py"))]
    return ["pretrain_leviathan", *scripts, *tools, *DOC_GENERATORS]


def test_reachability_catches_what_it_should():
    modules = {
        "pkg": ("from pkg import used\nfrom . import lazy_table\n", True),
        "pkg.used": ("import importlib\nimportlib.import_module('pkg.by_string')\n", False),
        "pkg.lazy_table": ("_LAZY = {'x': 'pkg.sub.deep'}\n", False),
        "pkg.by_string": ("", False),
        "pkg.sub": ("", True),
        "pkg.sub.deep": ("from ..used import thing\n", False),
        "pkg.accel": (
            "import importlib\nimportlib.import_module(f'{__name__}.{n}')\nPIECES = ('kernel',)\n",
            True,
        ),  # fmt: skip
        "pkg.accel.kernel": ("", False),
        "pkg.accel.other": ("", False),
        "pkg.testing": ("", True),
        "pkg.testing.helpers": ("import pkg.used\n", False),
    }
    reached = reachable_modules(modules, ["import pkg\nimport pkg.accel\n"])
    assert set(modules) - reached == {"pkg.accel.other", "pkg.testing", "pkg.testing.helpers"}
    assert reachable_modules(modules, ["pkg.sub.deep"]) == {
        "pkg", "pkg.sub", "pkg.sub.deep", "pkg.used", "pkg.lazy_table", "pkg.by_string",
    }  # fmt: skip


def test_the_wheel_holds_only_the_product(wheel):
    """Every module of the wheel is reached from a product entry point, and none is named like
    test-only code (tests, benchmarks and the docs' demo data live outside the package)."""
    modules = wheel_modules(wheel)
    assert "megatron_ext" in modules and "pretrain_leviathan" in modules
    named_like_tests = sorted(
        name for name in modules
        if TEST_ONLY_NAMES & set(name.split(".")) or name.rpartition(".")[2].startswith("test_")
    )  # fmt: skip
    assert not named_like_tests, f"test-only code in the wheel: {named_like_tests}"
    unreached = sorted(set(modules) - reachable_modules(modules, product_entries(wheel)))
    assert not unreached, (
        f"modules of the wheel that no entry point reaches (move what only tests, benchmarks "
        f"or docs use out of the package): {unreached}"
    )


def test_the_package_and_the_entry_are_imported_from_the_install(installed):
    code = "import json, megatron_ext, pretrain_leviathan; print(json.dumps([" \
           "megatron_ext.__file__, pretrain_leviathan.__file__]))"  # fmt: skip
    proc = _run([installed["python"], "-c", code], installed["cwd"], installed["env"])
    for path in json.loads(proc.stdout):
        assert path.startswith(installed["purelib"]), path
        assert not path.startswith(str(ROOT)), path
    # The CPU accelerations' C++ sources are package data (compiled on first use).
    csrc = Path(installed["purelib"]) / "megatron_ext/cpu_accel/csrc"
    assert sorted(p.name for p in csrc.glob("*.cpp")) == ["cross_entropy_cpu.cpp", "lev_cpu.cpp"]


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


def test_data_path_and_training_run_installed(installed, tmp_path):
    """The quick-start path from the installed package: corpus -> tokenizer -> datasets, then
    two ranks of pretrain_leviathan under torchrun (tests.support.runs, from a copy of
    tests/support alone on PYTHONPATH: the checkout's package stays invisible)."""
    support = tmp_path / "support"
    shutil.copytree(ROOT / "tests/support", support / "tests/support",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    env = dict(installed["env"], PYTHONPATH=str(support))
    code = """
import json, sys
from pathlib import Path
from tests.support.runs import TINY_LEV_MODEL, launch, prepare_sample_data
root = Path(sys.argv[1])
data = prepare_sample_data(root / "corpus", size_mb=0.1)
args = [*TINY_LEV_MODEL, *data, "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "0", "--num-workers", "0",
        "--no-loss-curve", "--log-interval", "1", "--save", str(root / "ckpt")]
run = launch(2, args, root / "run").check()
print(json.dumps(sorted(run.losses)))
"""
    proc = _run([installed["python"], "-c", code, installed["cwd"]], installed["cwd"], env)
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [1, 2, 3]
    log = (installed["cwd"] / "run" / "output.log").read_text()
    for checkout_file in (ROOT / "megatron_ext", ROOT / "pretrain_leviathan.py"):
        assert str(checkout_file) not in log  # nothing ran from the checkout
    ckpt = installed["cwd"] / "ckpt"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
