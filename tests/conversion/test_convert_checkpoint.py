"""tools/convert_checkpoint.py without the [eval] extra (transformers absent): export-hf and
import-hf stop with one line naming the package and the extra to install, before reading
anything; the other commands do not need it. An existing --output is refused before either."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

# The tool's main in an interpreter where `import transformers` fails as if it were absent.
WITHOUT_TRANSFORMERS = (
    "import sys; sys.modules['transformers'] = None; "
    "from megatron_ext.conversion.convert_checkpoint import main; sys.exit(main(sys.argv[1:]))"
)


def _convert(tmp_path, *argv: str) -> tuple[int, list[str]]:
    """(exit code, stderr lines but the log's) of the tool."""
    run = subprocess.run(
        [sys.executable, "-c", WITHOUT_TRANSFORMERS, *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    return run.returncode, [line for line in run.stderr.splitlines() if not line.startswith("[")]


@pytest.mark.parametrize(
    "argv",
    [["export-hf", "--load", "ckpt"], ["import-hf", "--hf-dir", "hf"]],
    ids=["export-hf", "import-hf"],
)
def test_hugging_face_commands_name_the_extra_to_install(tmp_path, argv):
    code, errors = _convert(tmp_path, *argv, "--output", "out")
    assert code == 2
    assert errors == [
        f"error: {argv[0]} needs the optional package transformers: pip install "
        "'megatron-ext-leviathan[eval]'"
    ]
    assert not (tmp_path / "out").exists()


def test_the_other_commands_run_without_transformers(tmp_path):
    code, errors = _convert(tmp_path, "reshard", "--load", "ckpt", "--output", "out")
    assert code == 2
    assert errors == ["error: checkpoint directory ckpt does not exist"]


@pytest.mark.parametrize(
    "argv",
    [["export-hf", "--load", "ckpt"], ["reshard", "--load", "ckpt"]],
    ids=["export-hf", "reshard"],
)
def test_an_existing_output_is_refused_before_anything_else(tmp_path, argv):
    """Checked before the converters (megatron-core, transformers: seconds) are imported: even
    the missing extra is not reported first."""
    (tmp_path / "out").mkdir()
    code, errors = _convert(tmp_path, *argv, "--output", "out")
    assert code == 2
    assert errors == ["error: output out already exists; pass --overwrite or pick another"]
