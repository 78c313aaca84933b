"""`DataConfig`: the training data and the tokenizer, with Megatron-LM's data and tokenizer
flags; `padded_vocab_size`; `DataError`, the data pipeline's one-line error.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from megatron_ext.config.flags import flag, flag_dataclass

__all__ = ["TOKENIZER_TYPE_NAMES", "VOCAB_MULTIPLE", "DataConfig", "DataError", "padded_vocab_size"]

TOKENIZER_TYPE_NAMES = tuple(
    "GPT2BPETokenizer GPTSentencePieceTokenizer HuggingFaceTokenizer NullTokenizer "
    "SentencePieceTokenizer TikTokenizer".split()
)
"""--tokenizer-type's choices (Megatron-LM's names), `data.tokenizers.TOKENIZER_TYPES`'s keys."""


class DataError(Exception):
    """A data-pipeline error whose message is one line that says what is wrong and what to do."""


VOCAB_MULTIPLE = 128
"""--make-vocab-size-divisible-by's default (Megatron-LM's)."""


def padded_vocab_size(vocab_size: int, divisible_by: int = VOCAB_MULTIPLE, tp_size: int = 1) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: round up to a multiple of ``divisible_by *
    tp_size``, so that the embedding and output layer split evenly across TP ranks."""
    if vocab_size <= 0 or divisible_by <= 0 or tp_size <= 0:
        raise ValueError(
            f"vocab_size, divisible_by and tp_size must be > 0, got "
            f"{vocab_size}, {divisible_by}, {tp_size}"
        )
    multiple = divisible_by * tp_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


@flag_dataclass
class DataConfig:
    """Where training data comes from and how samples are cut (fields named as the flags); the
    run's --seq-length and --seed are given to the dataset builder."""

    data_path: Optional[list[str]] = flag(
        None, "dataset prefix(es), optionally weighted: W1 P1 W2 P2 ...", nargs="*"
    )
    split: Optional[str] = flag(
        "969,30,1", "train,valid,test proportions of --data-path (default 969,30,1)"
    )
    train_data_path: Optional[list[str]] = flag(None, "training prefix(es), no split", nargs="*")
    valid_data_path: Optional[list[str]] = flag(None, "validation prefix(es)", nargs="*")
    test_data_path: Optional[list[str]] = flag(None, "test prefix(es)", nargs="*")
    data_cache_path: Optional[str] = flag(None, "directory for cached sample indices")
    mock_data: bool = flag(False, "synthetic data (Megatron-Core's MockGPTDataset)")
    tokenizer_type: Optional[str] = flag(
        None, "tokenizer kind (required)", shapes_model=True, choices=TOKENIZER_TYPE_NAMES
    )
    tokenizer_model: Optional[str] = flag(
        None, "SentencePiece .model, .tiktoken file or HF tokenizer directory", shapes_model=True
    )
    vocab_size: Optional[int] = flag(None, "for NullTokenizer", shapes_model=True)
    tiktoken_pattern: str = flag("o200k", "TikTokenizer split pattern: o200k, cl100k or a regex")
    vocab_file: Optional[str] = flag(None, "GPT2BPETokenizer vocab.json")
    merge_file: Optional[str] = flag(None, "GPT2BPETokenizer merges.txt")
    make_vocab_size_divisible_by: int = flag(
        VOCAB_MULTIPLE,
        "pad the vocabulary to a multiple of this times the TP size",
        shapes_model=True,
    )
    reset_position_ids: bool = flag(False, "restart position ids after each end-of-document token")
    reset_attention_mask: bool = flag(False, "do not attend across end-of-document tokens")
    eod_mask_loss: bool = flag(False, "mask the loss at end-of-document tokens")
    create_attention_mask: bool = flag(
        True,
        "build no attention mask per sample (the causal mask is implied)",
        dest="create_attention_mask_in_dataloader",
        action="store_false",
        name="--no-create-attention-mask-in-dataloader",
    )
    mmap_bin_files: bool = flag(
        True,
        "read .bin token files with file reads instead of mmap",
        dest="mmap_bin_files",
        action="store_false",
    )
    num_dataset_builder_threads: int = flag(1, "threads building the dataset indices")
    tokenizer_fingerprint: Optional[str] = None
    """The run's tokenizer's, once built (args.json records it; `data.fingerprint` reads it)."""

    def __post_init__(self) -> None:
        if self._sources() > 1:
            raise DataError(
                "choose one of --data-path, the per-split --*-data-path flags and --mock-data"
            )
        if self.data_path and not self.split:
            raise DataError("--data-path needs --split (e.g. 969,30,1)")
        for name, blend in (
            ("--data-path", self.data_path),
            ("--train-data-path", self.train_data_path),
            ("--valid-data-path", self.valid_data_path),
            ("--test-data-path", self.test_data_path),
        ):
            _check_blend(name, blend)

    def _sources(self) -> int:
        per_split = any([self.train_data_path, self.valid_data_path, self.test_data_path])
        return sum([bool(self.data_path), per_split, self.mock_data])

    def check_sources(self) -> None:
        """Refuse (DataError) a run that names no training data (a checkpoint's args.json that
        no training run wrote has none)."""
        if self._sources() == 0:
            raise DataError(
                "no training data: pass --data-path, or --train-data-path/--valid-data-path/"
                "--test-data-path, or --mock-data"
            )


def _is_weight(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return not os.path.isfile(value + ".idx")  # a dataset may have a numeric name


def _check_blend(flag: str, blend: Optional[Sequence[str]]) -> None:
    """A blend is prefixes only, or "W1 P1 W2 P2 ..." pairs; anything else (an odd count with a
    weight, a weight where a prefix belongs) is refused before it reads as a prefix "0.5"."""
    if not blend or not any(_is_weight(value) for value in blend):
        return
    pairs_ok = len(blend) % 2 == 0 and all(
        _is_weight(w) and not _is_weight(p) for w, p in zip(blend[::2], blend[1::2])
    )
    if not pairs_ok:
        raise DataError(
            f"{flag} {' '.join(blend)}: a weighted blend is pairs of weight and prefix "
            "(e.g. 0.7 data/a_text_document 0.3 data/b_text_document); give every prefix a "
            "weight, or give none"
        )
