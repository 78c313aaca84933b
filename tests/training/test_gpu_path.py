"""The GPU path as far as a CPU can check it: GPU flags and their refusals, and the GPU check
script (it parses, and its CPU-runnable parts pass in --cpu-dry-run on a tiny model)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.config_flags import flag_fields
from megatron_ext.training.arguments import ArgumentError, build_parser
from megatron_ext.training.config import EngineConfig, PrecisionConfig
from megatron_ext.training.gpu_arguments import validate_gpu_args

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]


def _args(*flags):
    return build_parser().parse_args([*BASE, *flags])


def test_every_gpu_flag_is_declared_by_its_config_field():
    parser = build_parser()
    owners = {
        "--ddp-impl": EngineConfig, "--overlap-grad-reduce": EngineConfig,
        "--overlap-param-gather": EngineConfig, "--ddp-bucket-size": EngineConfig,
        "--fp8-param-gather": EngineConfig, "--fp8-margin": PrecisionConfig,
        "--fp8-amax-history-len": PrecisionConfig, "--fp8-amax-compute-algo": PrecisionConfig,
    }  # fmt: skip
    for flag, cls in owners.items():
        (field,) = [f for f in flag_fields(cls) if f.metadata["flag"] == flag]
        action = parser._option_string_actions[flag]
        assert action.default == field.default, flag  # the command line's default is the field's
    args = _args(
        "--fp8-amax-history-len", "16", "--fp8-amax-compute-algo", "most_recent",
        "--fp8-margin", "1",
    )  # fmt: skip
    assert (args.fp8_amax_history_len, args.fp8_amax_compute_algo, args.fp8_margin) == (
        16, "most_recent", 1
    )  # fmt: skip
    assert args.ddp_impl == "portable"


@pytest.mark.parametrize(
    "flags, cuda, message",
    [
        (["--ddp-impl", "megatron"], False, "--ddp-impl megatron needs CUDA"),
        (["--fp8-param-gather", "--fp8-format", "hybrid"], True, "needs --ddp-impl megatron"),
        (
            ["--ddp-impl", "megatron", "--fp8-param-gather"],
            True,
            "--fp8-param-gather needs --fp8-format",
        ),
    ],
)
def test_gpu_flags_are_refused_where_they_cannot_work(flags, cuda, message):
    with pytest.raises(ArgumentError, match=message.replace("+", r"\+")):
        validate_gpu_args(_args(*flags), cuda=cuda)


def test_ddp_impl_megatron_refused_by_the_entry_parser_on_cpu():
    from megatron_ext.training import parse_args

    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    argv = [*BASE, "--ddp-impl", "megatron", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "128", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
            "--seq-length", "16"]  # fmt: skip
    with pytest.raises(ArgumentError) as error:
        parse_args(argv, world_size=1)
    assert str(error.value) == (
        "--ddp-impl megatron needs CUDA (megatron-core's DDP keeps its buffers on the "
        "GPU); use --ddp-impl portable on CPU"
    )


def test_gpu_check_script_parses_and_its_cpu_parts_pass(tmp_path):
    script = ROOT / "scripts/gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = tmp_path / "check.json"
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)  # the script sets it for the dry run itself
    proc = subprocess.run(
        ["bash", str(script), "--cpu-dry-run", "--out", str(out), "--time-budget-s", "400"],
        env=env,
        capture_output=True,
        text=True,
        timeout=470,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "cpu-dry-run" and result["status"] == "pass"
    checks = result["checks"]
    assert checks["triton_vs_torch"]["status"] == "pass"
    assert max(checks["triton_vs_torch"]["max_relative_error"].values()) < 2**-7
    for name in ("te_vs_local_logits", "fp8_steps", "engines_20_steps", "gpu_pytest"):
        assert checks[name]["status"] == "skipped" and "CUDA" in checks[name]["reason"]
    runs = result["throughput"]["runs"]
    assert set(runs) == {"lev_bf16", "tied_bf16"}
    for run in runs.values():
        assert run["status"] == "pass" and run["tokens_per_second"] > 0
        assert run["tflops_per_gpu"] > 0 and run["mfu"] is None  # no GPU peak on CPU
    assert result["throughput"]["lev_over_tied_step_time_bf16"] > 0
    assert "lev_bf16" in proc.stdout and "tok/s" in proc.stdout
    assert not list(tmp_path.glob("*.tmp"))


def test_container_files():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "FROM nvcr.io/nvidia/pytorch:${NGC_TAG}" in dockerfile
    assert "ARG NGC_TAG=25.12-py3" in dockerfile
    # NGC's torch stays: no pip line installs torch, our package goes in with --no-deps.
    installs = [line for line in dockerfile.splitlines() if "pip install" in line]
    assert installs and not any("torch" in line.split("#")[0] for line in installs)
    assert "--no-deps -e ." in dockerfile
    assert ".git" in (ROOT / ".dockerignore").read_text().split()
    sbatch = ROOT / "examples/slurm/pretrain_container.sbatch"
    assert subprocess.run(["bash", "-n", str(sbatch)]).returncode == 0
    text = sbatch.read_text()
    assert "--container-image=" in text and "#SBATCH --signal=TERM@300" in text
    assert "--exit-signal-handler" in text and "--save /ckpt --load /ckpt" in text


def test_portable_engine_notes_and_ignores_megatron_ddp_flags(caplog):
    import logging

    for cuda, where in ((False, "on CPU"), (True, "by --ddp-impl portable")):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            validate_gpu_args(_args("--overlap-grad-reduce", "--ddp-bucket-size", "8"), cuda=cuda)
        assert f"--overlap-grad-reduce: ignored {where}" in caplog.text
        assert f"--ddp-bucket-size: ignored {where}" in caplog.text


def test_megatron_engine_refuses_what_it_does_not_do_yet():
    # --save/--load and --fp16 are TrainingConfig's checks (tests/training/test_config.py).
    from megatron_ext.training.gpu_arguments import megatron_engine_model_precision

    validate_gpu_args(_args("--ddp-impl", "megatron"), cuda=True)
    args = _args("--ddp-impl", "megatron", "--bf16", "--fp8-format", "hybrid", "--fp8-param-gather")
    with pytest.raises(ArgumentError, match="--fp8-param-gather is not supported by --ddp-impl"):
        validate_gpu_args(args, cuda=True)
    # BF16 parameters and the FP8 recipe go into the model precision (TransformerConfig fields).
    args = _args("--ddp-impl", "megatron", "--bf16", "--fp8-format", "hybrid",
                 "--fp8-amax-history-len", "16")  # fmt: skip
    precision = megatron_engine_model_precision(args)
    assert precision.bf16 and precision.fp8_format == "hybrid"
    assert precision.fp8_amax_history_len == 16 and precision.dtype == torch.bfloat16


def test_the_engine_decides_the_models_parameter_dtype_in_one_place():
    """Portable engine: float32 parameters whatever --bf16/--fp16 say (autocast runs them);
    megatron's engine: BF16 parameters and the FP8 recipe in the TransformerConfig fields."""
    from megatron_ext.models import ModelConfig, ModelPrecision, compose_transformer_config
    from megatron_ext.training.config import (
        BatchConfig,
        EngineConfig,
        OptimizerConfig,
        PrecisionConfig,
        TrainingConfig,
    )
    from megatron_ext.training.gpu_arguments import engine_model_precision

    batch, optim = BatchConfig(seq_length=8), OptimizerConfig(lr=1e-3)
    portable = TrainingConfig(batch=batch, optim=optim, precision=PrecisionConfig(bf16=True))
    assert engine_model_precision(portable) == ModelPrecision()
    tc = compose_transformer_config(ModelConfig(vocab_size=64), None, ModelPrecision())
    assert tc.params_dtype == torch.float32 and not tc.bf16
    precision = PrecisionConfig(bf16=True, fp8_format="hybrid", fp8_amax_history_len=16)
    megatron = TrainingConfig(
        batch=batch, optim=optim, precision=precision, engine=EngineConfig(ddp_impl="megatron")
    )
    model_precision = engine_model_precision(megatron)
    assert model_precision.bf16 and not model_precision.fp16
    assert model_precision.fp8_amax_history_len == 16
    # The recipe reaches the TransformerConfig (without FP8, which needs Transformer Engine).
    tc = compose_transformer_config(
        ModelConfig(vocab_size=64), None, dataclasses.replace(model_precision, fp8_format=None)
    )
    assert tc.bf16 and tc.params_dtype == torch.bfloat16 and tc.fp8_amax_history_len == 16
