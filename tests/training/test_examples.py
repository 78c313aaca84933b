"""The paper recipes: every arm x scale (and the vocabulary ablation) parses and validates at
its default layout on 8 GPUs, with identical hyper-parameters across arms."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from megatron_ext.config.arguments import parse_config

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "recipes" / "pretrain.sh"
ARMS = ("tied", "untied", "albert", "flat-mlp", "factored-mlp", "lev")


def _recipe_argv(*recipe_args: str) -> list[str]:
    out = subprocess.run(
        ["bash", str(RECIPE), *recipe_args],
        env={"PATH": "/usr/bin:/bin", "LAUNCH": "echo"},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    argv = shlex.split(out)
    assert argv[0] == "pretrain_leviathan.py"
    return argv[1:]


def _without_arm(argv: list[str], arm: str) -> list[str]:
    """The flags with the arm's own name and output directories taken out."""
    i = argv.index("--embedding-type")
    return [a.replace(f"/{arm}-", "/ARM-") for a in argv[:i] + argv[i + 2 :]]


@pytest.mark.parametrize("size", ["200m", "400m", "1.2b"])
def test_recipes_share_hyper_parameters_and_validate(size):
    from megatron_ext.config.layout import check_layout

    argvs = {arm: _recipe_argv(size, arm) for arm in ARMS}
    reference = _without_arm(argvs["lev"], "lev")
    for arm, argv in argvs.items():
        assert _without_arm(argv, arm) == reference, f"{arm} differs from lev beyond the arm"
        run = parse_config(argv, world_size=8)
        assert run.model.seq_length == 512 and run.batch.global_batch_size == 512
        model = run.model.replace(vocab_size=200064)  # o200k padded
        check_layout(model, run.parallel)  # the recipe's TP/PP fit the model at its vocabulary
        assert model.embedding.embedding_type == arm
        # The paper's recipes set their choices where Megatron-LM's defaults differ.
        assert (model.hidden_dropout, model.attention_dropout) == (0.0, 0.0)
        assert run.eval.eval_interval is not None
    tokens = run.batch.train_iters * 512 * 512
    assert {"200m": 4.0e9, "400m": 8.0e9, "1.2b": 24.1e9}[size] == pytest.approx(tokens, rel=1e-3)


def test_vocabulary_ablation_recipes():
    for vocab in ("50k", "100k", "200k"):
        argv = _recipe_argv("400m", "lev", vocab)
        assert f"pile_sp{vocab}.model" in " ".join(argv)
        parse_config(argv, world_size=8)


def test_slurm_launcher_is_valid_bash():
    subprocess.run(["bash", "-n", str(REPO / "examples" / "slurm" / "pretrain.sbatch")], check=True)
