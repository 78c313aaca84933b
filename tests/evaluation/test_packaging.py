"""The eval extra installs everything the documented evaluation commands import."""

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the project allows 3.10


ROOT = Path(__file__).resolve().parents[2]


def test_eval_extra_installs_accelerate_for_lm_eval_hf_model():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    names = {req.split("==")[0].split("[")[0] for req in extras["eval"]}
    # lm_eval --model hf (docs/convert.md) fails with "No module named 'accelerate'" without it.
    assert {"accelerate", "lm-eval", "transformers", "safetensors"} <= names
