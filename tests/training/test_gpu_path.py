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

from megatron_ext.config.arguments import ArgumentError, build_parser, check_machine, parse_config
from megatron_ext.config.flags import flag_fields, flag_name
from megatron_ext.config.layout import PrecisionConfig
from megatron_ext.config.run import EngineConfig

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]
RUN = [
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--seq-length", "16",
]  # fmt: skip


def _run(*flags, cuda: bool = False):
    """The run of BASE + RUN + `flags`, as parsed on a machine with CUDA or without."""
    return parse_config([*BASE, *RUN, *flags], world_size=1, cuda=cuda)


def test_every_gpu_flag_is_declared_by_its_config_field():
    parser = build_parser()
    owners = {
        "--ddp-impl": EngineConfig, "--overlap-grad-reduce": EngineConfig,
        "--overlap-param-gather": EngineConfig, "--ddp-bucket-size": EngineConfig,
        "--fp8-param-gather": PrecisionConfig, "--fp8-margin": PrecisionConfig,
        "--fp8-amax-history-len": PrecisionConfig, "--fp8-amax-compute-algo": PrecisionConfig,
    }  # fmt: skip
    for flag, cls in owners.items():
        (field,) = [f for f in flag_fields(cls) if flag_name(f) == flag]
        action = parser._option_string_actions[flag]
        assert action.default == field.default, flag  # the command line's default is the field's
    # Megatron-LM's FP8 recipe defaults, written once (the fields'), as TransformerConfig's.
    assert (parser.get_default("fp8_amax_history_len"), parser.get_default("fp8_margin")) == (1, 0)
    assert parser.get_default("fp8_amax_compute_algo") == "most_recent"
    run = _run(
        "--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "16",
        "--fp8-amax-compute-algo", "max", "--fp8-margin", "1",
        "--transformer-impl", "transformer_engine", cuda=True,
    )  # fmt: skip
    p = run.precision
    assert (p.fp8_amax_history_len, p.fp8_amax_compute_algo, p.fp8_margin) == (16, "max", 1)
    assert p.fp8_recipe() == dict(margin=1, amax_history_len=16, amax_compute_algo="max")
    assert run.engine.ddp_impl == "portable" and p.params_dtype == "float32"


# What megatron-core's distributed optimizer needs to gather FP8 parameters (on CUDA).
FP8_GATHER = ["--ddp-impl", "megatron", "--use-distributed-optimizer", "--bf16",
              "--fp8-format", "hybrid", "--transformer-impl", "transformer_engine"]  # fmt: skip
FP8_GATHER_REFUSED = (
    "--fp8-param-gather needs megatron-core's distributed optimizer with FP8: --ddp-impl "
    "megatron --use-distributed-optimizer --fp8-format; drop it otherwise"
)


@pytest.mark.parametrize(
    "flags, cuda, message",
    [
        (["--ddp-impl", "megatron"], False, "--ddp-impl megatron needs CUDA"),
        (["--fp8-param-gather", "--fp8-format", "hybrid", "--bf16"], True, FP8_GATHER_REFUSED),
        (["--ddp-impl", "megatron", "--fp8-param-gather"], True, FP8_GATHER_REFUSED),
        (["--fp8-param-gather", *FP8_GATHER[:2], *FP8_GATHER[3:]], True, FP8_GATHER_REFUSED),
        (["--fp8-param-gather"], False, FP8_GATHER_REFUSED),
        (["--fp8-param-gather", *FP8_GATHER], False, "--transformer-impl transformer_engine needs"),
        (["--fp8-param-gather", *FP8_GATHER[:-2]], False, "--fp8-format needs --transformer-impl"),
    ],
)
def test_gpu_flags_are_refused_where_they_cannot_work(flags, cuda, message):
    """One line each; --fp8-param-gather everywhere but megatron-core's distributed optimizer
    with FP8 by the same one line (before issue 47 both engines refused it, with two messages
    that contradicted each other)."""
    with pytest.raises(ArgumentError) as error:
        _run(*flags, cuda=cuda)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


def test_fp8_param_gather_is_accepted_where_it_can_work():
    """Megatron-LM's LLaMA-3 FP8 recipe gathers FP8 parameters through megatron-core's
    distributed optimizer: accepted there (CUDA), reaching megatron's DDP config and the
    model's TransformerConfig (fp8_param: Transformer Engine keeps the weights in FP8)."""
    run = _run("--fp8-param-gather", *FP8_GATHER, cuda=True)
    assert run.precision.fp8_param_gather and run.precision.params_dtype == "bfloat16"
    assert run.args_json()["fp8_param_gather"] is True
    row = next(r for r in _compat_rows() if r.startswith("| `--fp8-param-gather` |"))
    assert "| implemented |" in row and "--use-distributed-optimizer" in row


def _compat_rows() -> list[str]:
    from megatron_ext.config.megatron_compat import compat_table

    return compat_table(build_parser()).splitlines()


def test_ddp_impl_megatron_refused_by_the_entry_parser_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU refusal")
    argv = [*BASE, "--ddp-impl", "megatron", *RUN]
    with pytest.raises(ArgumentError) as error:
        parse_config(argv, world_size=1)
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


def test_gpu_check_help_is_clean_and_complete(tmp_path):
    """`gpu_check --help` prints its usage and nothing before it (no import-time warnings), and
    every option says what it does and its default."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--help"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: gpu_check.py"), proc.stdout[:500]
    text = " ".join(proc.stdout.split())
    assert "--out OUT the JSON file to write (default: gpu_check.json)" in text, text
    assert "--time-budget-s TIME_BUDGET_S seconds for all phases" in text, text
    assert "(default: 450.0)" in text, text
    assert "--iters ITERS throughput iterations (default: 12 on a GPU, 4 with" in text, text
    assert "--warmup WARMUP iterations left out of timing (default: 4 on a GPU" in text, text
    assert list(tmp_path.iterdir()) == []


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

    run = _run("--overlap-grad-reduce", "--ddp-bucket-size", "8")
    for cuda, where in ((False, "on CPU"), (True, "by --ddp-impl portable")):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            check_machine(run, cuda=cuda)
        assert f"--overlap-grad-reduce: ignored {where}" in caplog.text
        assert f"--ddp-bucket-size: ignored {where}" in caplog.text


def test_the_engine_decides_the_models_parameter_dtype_in_one_place():
    """Portable engine: float32 parameters whatever --bf16/--fp16 say (autocast runs them);
    megatron's engine: BF16 parameters (`RunConfig` derives `PrecisionConfig.params_dtype`),
    and the FP8 recipe in the TransformerConfig fields, whichever engine."""
    from megatron_ext.config.layout import PrecisionConfig
    from megatron_ext.config.model import ModelConfig
    from megatron_ext.config.run import (
        BatchConfig,
        EngineConfig,
        OptimizerConfig,
        RunConfig,
    )
    from megatron_ext.models import compose_transformer_config

    batch, optim, model = BatchConfig(), OptimizerConfig(lr=1e-3), ModelConfig(vocab_size=64)
    portable = RunConfig(batch, optim, model, precision=PrecisionConfig(bf16=True))
    assert portable.precision.params_dtype == "float32"
    tc = compose_transformer_config(model, None, portable.precision)
    assert tc.params_dtype == torch.float32 and not tc.bf16
    precision = PrecisionConfig(bf16=True, fp8_format="hybrid", fp8_amax_history_len=16)
    te = ModelConfig(vocab_size=64, transformer_impl="transformer_engine")
    megatron = RunConfig(
        batch, optim, te, precision=precision, engine=EngineConfig(ddp_impl="megatron")
    )
    model_precision = megatron.precision
    assert model_precision.bf16 and model_precision.params_dtype == "bfloat16"
    assert model_precision.fp8_amax_history_len == 16
    # The recipe reaches the TransformerConfig (TE builds the FP8 layers; on CPU the config).
    tc = compose_transformer_config(te, None, model_precision)
    assert tc.bf16 and tc.params_dtype == torch.bfloat16 and tc.fp8 == "hybrid"
    assert (tc.fp8_amax_history_len, tc.fp8_amax_compute_algo, tc.fp8_param) == (
        16, "most_recent", False
    )  # fmt: skip
    gather = dataclasses.replace(model_precision, fp8_param_gather=True)
    assert compose_transformer_config(te, None, gather).fp8_param
    with pytest.raises(ValueError, match="FP8 is not available on CPU"):
        compose_transformer_config(model, None, model_precision)
