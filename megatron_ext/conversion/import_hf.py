"""import-hf: a Hugging Face Llama checkpoint -> a TIED or UNTIED training checkpoint; a
`LeviathanForCausalLM` (export-hf --hf-format leviathan) -> a LEV training checkpoint.

The result is an ordinary checkpoint directory (`iter_0000000/`, DCP, `args.json` holding the
model flags derived from config.json) without optimizer or RNG state, so that

    pretrain_leviathan.py --load <out> --finetune --use-checkpoint-args ...

starts training from its weights at iteration 0, at any TP/PP layout. The tokenizer files of
the Hugging Face directory are copied into `<out>/tokenizer` and recorded as the run's
`--tokenizer-type HuggingFaceTokenizer`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_ext.checkpoint.format import TrainState, save_checkpoint
from megatron_ext.config.arguments import args_json_of_flags, model_config_from_args_json
from megatron_ext.config.data import VOCAB_MULTIPLE, padded_vocab_size
from megatron_ext.config.layout import ParallelConfig, PrecisionConfig
from megatron_ext.conversion.common import ConversionError, atomic_output_dir, new_output
from megatron_ext.conversion.hf import (
    LEV_CONFIG_FIELDS,
    LEVIATHAN_ARCHITECTURE,
    from_hf_state_dict,
    read_hf_checkpoint,
)
from megatron_ext.data.tokenizers import EXPORT_PROVENANCE_FILE, TokenizerError, build_tokenizer
from megatron_ext.inference.loading import init_inference_parallel
from megatron_ext.models import build_model
from megatron_ext.models.full_state_dict import load_full_state_dict

__all__ = ["ImportHFOptions", "import_hf", "TOKENIZER_FILES"]

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    EXPORT_PROVENANCE_FILE,  # which tokenizer an export came from
)


@dataclass(frozen=True)
class ImportHFOptions:
    """Arguments of `import_hf`: the Hugging Face directory, the output checkpoint directory and
    the model flags to record for the run."""

    hf_dir: str
    output: str
    embedding_type: Optional[str] = None
    """tied or untied (default: tied when config.json ties the embeddings); lev for (and only
    for) a LeviathanForCausalLM."""
    seq_length: Optional[int] = None
    """--seq-length recorded for the run (default: max_position_embeddings, at most 4096)."""
    make_vocab_size_divisible_by: int = VOCAB_MULTIPLE
    overwrite: bool = False


def _model_flags(config: dict, arm: str, opts: ImportHFOptions) -> list[str]:
    heads = config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    theta = config.get("rope_theta")
    if theta is None:
        theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    if float(theta) != int(theta):
        raise ConversionError(f"rope_theta {theta} is not an integer (--rotary-base takes one)")
    seq = opts.seq_length or min(int(config.get("max_position_embeddings", 4096)), 4096)
    flags = [
        "--num-layers", str(config["num_hidden_layers"]),
        "--hidden-size", str(config["hidden_size"]),
        "--num-attention-heads", str(heads),
        "--ffn-hidden-size", str(config["intermediate_size"]),
        "--seq-length", str(seq),
        "--rotary-base", str(int(theta)),
        "--norm-epsilon", str(config.get("rms_norm_eps", 1e-5)),
        "--embedding-type", arm,
        "--make-vocab-size-divisible-by", str(opts.make_vocab_size_divisible_by),
    ]  # fmt: skip
    if groups != heads:
        flags += ["--group-query-attention", "--num-query-groups", str(groups)]
    if arm == "lev":
        for field in LEV_CONFIG_FIELDS:
            value, name = config[f"lev_{field}"], field.replace("_", "-")
            if isinstance(value, bool):
                flags.append(f"--{'' if value else 'no-'}lev-{name}")
            else:
                flags += [f"--lev-{name}", repr(value) if isinstance(value, float) else str(value)]
    return flags


def is_leviathan(config: dict) -> bool:
    """Whether config.json describes a `LeviathanForCausalLM` (LEV kept)."""
    arch = config.get("architectures") or []
    return config.get("model_type") == "leviathan" or LEVIATHAN_ARCHITECTURE in arch


def _check_lev_fields(config: dict, tensors: dict, path: str) -> None:
    """config.json's lev_* fields against LEV's weights: one line naming the first mismatch."""
    missing = [f"lev_{f}" for f in LEV_CONFIG_FIELDS if config.get(f"lev_{f}") is None]
    if missing:
        raise ConversionError(
            f"{path}/config.json describes a LeviathanForCausalLM but lacks {', '.join(missing)}"
        )
    k, b, d = (config[f"lev_{f}"] for f in ("num_digits", "base", "seed_dim"))
    h, kappa, r = (config[f"lev_{f}"] for f in ("num_heads", "num_knots", "rank"))
    d_in = k * d if config["lev_codebook_combine"] == "concat" else d
    expected = {
        "codebooks": (k, b, d),
        "seed_proj": (h, d, d_in),
        "seed_norm_weight": (h, d),
        "seed_norm_bias": (h, d),
        "spline_delta": (h, d, kappa, r),
        "out_proj": (h, r, config["hidden_size"]),
    }
    for name, shape in expected.items():
        got = tensors.get(f"model.embed_tokens.{name}")
        if got is None:
            raise ConversionError(f"{path} has no LEV weight model.embed_tokens.{name}")
        if tuple(got.shape) != shape:
            raise ConversionError(
                f"{path}: model.embed_tokens.{name} is {list(got.shape)} but config.json's lev_* "
                f"fields imply {list(shape)}; the config does not describe these weights"
            )
    if "lm_head.weight" not in tensors:
        raise ConversionError(f"{path} has no lm_head.weight (a LEV model's head is its own)")


def _arm(config: dict, tensors: dict, opts: ImportHFOptions) -> tuple[str, bool]:
    """(the --embedding-type to import as, whether the model is a LeviathanForCausalLM)."""
    lev = is_leviathan(config)
    if lev:
        if opts.embedding_type not in (None, "lev"):
            raise ConversionError(
                f"{opts.hf_dir} is a LeviathanForCausalLM: it imports as --embedding-type lev, "
                f"not {opts.embedding_type}; drop --embedding-type"
            )
        _check_lev_fields(config, tensors, opts.hf_dir)
    tied_in_hf = not lev and (
        bool(config.get("tie_word_embeddings", False)) or "lm_head.weight" not in tensors
    )
    arm = "lev" if lev else opts.embedding_type or ("tied" if tied_in_hf else "untied")
    if not lev and arm not in ("tied", "untied"):
        raise ConversionError(
            f"import-hf makes a tied or untied model, not --embedding-type {arm}: a Hugging Face "
            "model has a plain input table (fine-tune LEV and the other arms from scratch)"
        )
    if arm == "tied" and not tied_in_hf:
        if not torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise ConversionError(
                f"{opts.hf_dir} has separate input and output tables; import it with "
                "--embedding-type untied"
            )
    return arm, lev


def _tokenizer(hf_dir: str) -> tuple[list[str], int, str]:
    """(the tokenizer files of `hf_dir`, its vocabulary size, its fingerprint)."""
    files = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(hf_dir, f))]
    if not files:
        raise ConversionError(
            f"{hf_dir} holds no tokenizer files (tokenizer.json ...); save the tokenizer "
            "into the model directory (tokenizer.save_pretrained) first"
        )
    # Read from a copy of the tokenizer files alone, as the run will read them (<out>/tokenizer):
    # beside a config.json with `auto_map` (a LeviathanForCausalLM) AutoTokenizer would ask
    # whether to run the model's code.
    with tempfile.TemporaryDirectory() as alone:
        for name in files:
            shutil.copy2(os.path.join(hf_dir, name), os.path.join(alone, name))
        try:
            tokenizer = build_tokenizer("HuggingFaceTokenizer", alone)
        except TokenizerError as error:
            raise ConversionError(str(error).replace(alone, hf_dir)) from None
        return files, tokenizer.vocab_size, tokenizer.fingerprint  # read from its files


def import_hf(opts: ImportHFOptions) -> str:
    """Write the checkpoint directory; returns its path."""
    output = new_output(opts.output, opts.overwrite)
    config, tensors = read_hf_checkpoint(opts.hf_dir)
    arm, lev = _arm(config, tensors, opts)
    files, vocab, fingerprint = _tokenizer(opts.hf_dir)
    hf_vocab = config["vocab_size"]
    if vocab > hf_vocab:
        raise ConversionError(
            f"the tokenizer of {opts.hf_dir} has {vocab} ids but the model embeds "
            f"only {hf_vocab}: vocabulary mismatch"
        )
    padded = padded_vocab_size(vocab, opts.make_vocab_size_divisible_by)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        if key in tensors and tensors[key].size(0) > padded:
            # Rows beyond the tokenizer's ids are never used; the run re-pads to `padded`.
            tensors[key] = tensors[key][:padded]
    tensors = {k: v.float() for k, v in tensors.items()}

    tokenizer_dir = os.path.join(output, "tokenizer")
    flags = _model_flags(config, arm, opts) + [
        "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", tokenizer_dir,
    ]  # fmt: skip
    args_json = {**args_json_of_flags(flags), "tokenizer_fingerprint": fingerprint}
    try:
        model_config = model_config_from_args_json(args_json).replace(vocab_size=padded)
    except ValueError as error:  # LEV's fields checked at the padded vocabulary
        raise ConversionError(f"{opts.hf_dir}/config.json: {error}") from None
    full = from_hf_state_dict(
        tensors,
        num_attention_heads=model_config.num_attention_heads,
        num_query_groups=model_config.num_query_groups,
        tied=arm == "tied",
        padded_vocab=padded,
        lev=lev,
    )
    pg = init_inference_parallel(1, 1)
    # Initialised (then overwritten): megatron tags the TP layout of a weight while it
    # initialises it, and the checkpoint layout depends on those tags.
    model = build_model(model_config, parallel=ParallelConfig(), precision=PrecisionConfig(), pg=pg)
    try:
        load_full_state_dict(model, full, pg.tp)
    except (KeyError, ValueError) as error:
        raise ConversionError(f"{opts.hf_dir}: {error}") from None
    with atomic_output_dir(output, opts.overwrite) as tmp:
        os.makedirs(os.path.join(tmp, "tokenizer"))
        for name in files:
            shutil.copy2(os.path.join(opts.hf_dir, name), os.path.join(tmp, "tokenizer", name))
        save_checkpoint(tmp, TrainState(), model, pg=pg, args_json=args_json, save_rng=False)
    logger.info(
        "imported %s as a --embedding-type %s checkpoint (vocabulary %d, padded %d)",
        opts.hf_dir,
        arm,
        vocab,
        padded,
    )
    return output
