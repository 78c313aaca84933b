"""Convert checkpoints: Hugging Face export/import, Megatron-LM export, offline resharding;
check a checkpoint's digests; break a --save lock.

    python tools/convert_checkpoint.py export-hf --load ckpt/lev --output hf/lev --dtype bfloat16
    python tools/convert_checkpoint.py import-hf --hf-dir hf/llama --output ckpt/llama-import
    python tools/convert_checkpoint.py reshard --load ckpt/lev --output ckpt/lev-tp1 \\
        --target-tensor-parallel-size 1 --no-optimizer
    python tools/convert_checkpoint.py verify --load ckpt/lev

Every converting subcommand verifies the source's digests first (--no-verify-checkpoint skips
it) and writes its output under a temporary name, renamed when complete. `verify` exits 0 when
every file matches, 1 when one does not, 2 on bad input. See docs/convert.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch

from megatron_ext._paths import display_path
from megatron_ext.checkpoint.io_errors import CheckpointDigestError, CheckpointError
from megatron_ext.checkpoint.lock import break_lock
from megatron_ext.cli import run_tool
from megatron_ext.config.data import DataConfig
from megatron_ext.config.flags import ArgumentParser, add_flags
from megatron_ext.config.model import EmbeddingConfig, ModelConfig
from megatron_ext.conversion.common import DTYPES, HF_FORMATS, ConversionError, new_output
from megatron_ext.data.tokenizers import TokenizerError

# What export-hf and import-hf need beyond the core (the [eval] extra).
_HF_PACKAGES = ("transformers", "safetensors", "tokenizers", "huggingface_hub")


def _add_checkpoint(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load", required=True, help="a run's --save directory or an iter_XXXXXXX")
    p.add_argument(
        "--ckpt-step",
        "--iteration",
        dest="ckpt_step",
        type=int,
        default=None,
        help="iteration to read (default: the latest)",
    )


def _add_source(p: argparse.ArgumentParser, export: bool) -> None:
    """The checkpoint to read and the directory to write; an export's arm check and dtypes."""
    _add_checkpoint(p)
    p.add_argument(
        "--no-verify-checkpoint",
        dest="verify",
        action="store_false",
        help="read the checkpoint without first checking its files against their digests",
    )
    p.add_argument(
        "--tokenizer-model",
        default=None,
        help="the run's tokenizer, if not where it recorded it (for GPT2BPETokenizer: the "
        "directory holding its vocab and merge files)",
    )
    if export:
        p.add_argument(
            "--embedding-type", default=None, help="refuse the checkpoint unless it holds this arm"
        )
    _add_output(p)
    if export:
        p.add_argument("--dtype", choices=tuple(DTYPES), default="float32", help="stored dtype")
        p.add_argument(
            "--compute-dtype",
            choices=("float64", "float32"),
            default="float64",
            help="precision of the materialised input table before the cast to --dtype",
        )


def _add_target_layout(p: argparse.ArgumentParser, what: str) -> None:
    for kind in ("tensor", "pipeline"):
        p.add_argument(
            f"--target-{kind}-parallel-size",
            type=int,
            default=1,
            help=f"{kind}-parallel size of the {what}",
        )


def _add_output(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", required=True, help="directory to create")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "export-hf", help="training checkpoint -> Hugging Face LlamaForCausalLM or Leviathan"
    )
    _add_source(p, export=True)
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard limit (5GB)")
    p.add_argument(
        "--keep-padded-vocab",
        action="store_true",
        help="keep the make-vocab-size-divisible-by padding rows (default: trim to the tokenizer)",
    )
    p.add_argument("--no-tokenizer", action="store_true", help="do not write tokenizer files")
    p.add_argument(
        "--hf-format",
        choices=HF_FORMATS,
        default="llama",
        help="llama: LlamaForCausalLM, the input module materialised into a [V, D] table (any "
        "arm; loads everywhere Llama does); leviathan: LeviathanForCausalLM, LEV kept as LEV "
        "(LEV checkpoints; trust_remote_code=True without this package)",
    )

    p = sub.add_parser(
        "import-hf", help="Hugging Face Llama -> TIED/UNTIED (Leviathan -> LEV) training checkpoint"
    )
    p.add_argument(
        "--hf-dir", required=True, help="a LlamaForCausalLM or LeviathanForCausalLM directory"
    )
    _add_output(p)
    add_flags(
        p,
        EmbeddingConfig,
        "embedding_type",
        choices=("tied", "untied"),
        default=None,
        help="tied or untied (default: tied when config.json ties the embeddings)",
    )
    add_flags(
        p,
        ModelConfig,
        "seq_length",
        help="the run's --seq-length (default: config.json's max_position_embeddings, at most "
        "4096)",
    )
    add_flags(p, DataConfig, "make_vocab_size_divisible_by")

    p = sub.add_parser("export-megatron", help="any arm -> Megatron-LM legacy checkpoint")
    _add_source(p, export=True)
    _add_target_layout(p, "Megatron-LM checkpoint")

    p = sub.add_parser("reshard", help="rewrite a checkpoint for another TP/PP layout")
    _add_source(p, export=False)
    _add_target_layout(p, "resharded checkpoint")
    p.add_argument("--no-optimizer", action="store_true", help="drop the optimizer state")

    p = sub.add_parser(
        "verify",
        help="check every file of a checkpoint against the digests recorded when it was saved "
        "(no model is built): exit 0 all match, 1 a file does not, 2 bad input",
    )
    _add_checkpoint(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = sub.add_parser(
        "unlock",
        help="remove the lock of a --save directory left by a run that is gone (a training run "
        "refuses a --save another run holds)",
    )
    p.add_argument("--save", required=True, help="the run's --save directory")
    p.add_argument(
        "--force", action="store_true", help="even when the holder still runs on this host"
    )
    return parser


def run(args: argparse.Namespace) -> str:
    new_output(args.output, args.overwrite)  # its one-line error before the slow imports
    if args.command in ("export-hf", "import-hf"):
        try:
            # optional: the [eval] extra; deferred too: megatron.core (slow), which --help skips
            from megatron_ext.conversion import export_hf, import_hf
        except ModuleNotFoundError as error:
            if (error.name or "").split(".")[0] not in _HF_PACKAGES:
                raise
            raise ConversionError(
                f"{args.command} needs the optional package {error.name}: pip install "
                "'megatron-ext-leviathan[eval]'"
            ) from None
    else:
        # deferred: the converters import megatron.core (slow), which --help does without
        from megatron_ext.conversion import export_megatron, reshard

    if args.command == "import-hf":
        return import_hf.import_hf(
            import_hf.ImportHFOptions(
                hf_dir=args.hf_dir,
                output=args.output,
                embedding_type=args.embedding_type,
                seq_length=args.seq_length,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                overwrite=args.overwrite,
            )
        )
    common = dict(
        load=args.load,
        output=args.output,
        iteration=args.ckpt_step,
        tokenizer_model=args.tokenizer_model,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        verify=args.verify,
    )
    if args.command == "reshard":
        return reshard.reshard(
            reshard.ReshardOptions(
                **common,
                tensor_model_parallel_size=args.target_tensor_parallel_size,
                pipeline_model_parallel_size=args.target_pipeline_parallel_size,
                keep_optimizer=not args.no_optimizer,
            )
        )
    common.update(
        dtype=DTYPES[args.dtype],
        compute_dtype=getattr(torch, args.compute_dtype),
        embedding_type=args.embedding_type,
    )
    if args.command == "export-hf":
        return export_hf.export_hf(
            export_hf.ExportHFOptions(
                **common,
                keep_padded_vocab=args.keep_padded_vocab,
                max_shard_size=args.max_shard_size,
                export_tokenizer=not args.no_tokenizer,
                hf_format=args.hf_format,
            )
        )
    return export_megatron.export_megatron(
        export_megatron.ExportMegatronOptions(
            **common,
            tensor_model_parallel_size=args.target_tensor_parallel_size,
            pipeline_model_parallel_size=args.target_pipeline_parallel_size,
        )
    )


def verify(args: argparse.Namespace) -> int:
    """`verify`: 0 when every file of the checkpoint matches its digest, 1 when one does not
    (an `error:` line naming the file and the newest older checkpoint that verifies)."""
    # deferred: keeps megatron.core (slow) out of this module's import
    from megatron_ext.checkpoint.format import checkpoint_dir, locate_checkpoint, verify_or_raise

    root, iteration = locate_checkpoint(args.load, args.ckpt_step)
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        raise ConversionError(f"checkpoint {display_path(path)} does not exist")
    try:
        verified = verify_or_raise(root, iteration, progress=not args.no_progress, announce=False)
    except CheckpointDigestError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 1
    if not verified.has_digests:
        raise ConversionError(
            f"{display_path(path)} records no digests (saved before digests were recorded, or "
            "by another tool): there is nothing to verify it against"
        )
    print(
        f"verify: {display_path(path)}: {verified.files} files ({verified.bytes / 2**20:.1f} MiB) "
        "match their digests",
        flush=True,
    )
    return 0


def unlock(args: argparse.Namespace) -> int:
    """`unlock`: remove the lock of a --save directory (see checkpoint/lock.py)."""
    if not os.path.isdir(args.save):
        raise ConversionError(f"--save {display_path(args.save)} does not exist")
    holder = break_lock(args.save, force=args.force)
    if holder is None:
        print(f"unlock: {display_path(args.save)} holds no lock", flush=True)
    else:
        print(f"unlock: removed the lock of {display_path(args.save)} (held by {holder})")
    return 0


def _main(argv: Optional[Sequence[str]]) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("verify", "unlock"):
        return (verify if args.command == "verify" else unlock)(args)
    print(f"{args.command}: wrote {display_path(run(args))}", flush=True)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_tool(
        _main,
        argv,
        errors=(ConversionError, CheckpointError, TokenizerError),
        interrupted="interrupted: nothing was written",
    )


if __name__ == "__main__":
    sys.exit(main())
