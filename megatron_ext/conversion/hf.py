"""Hugging Face `LlamaForCausalLM` <-> our single-stage parameter names (megatron-core's:
`decoder.layers.i.self_attention.linear_qkv` <-> q_proj | k_proj | v_proj, `mlp.linear_fc1`
[2F, D] <-> gate_proj ; up_proj, `output_layer` <-> lm_head, absent when tied). The LEV arm
exported as `LeviathanForCausalLM` keeps LEV's parameters: embedding.word_embeddings.<p> <->
model.embed_tokens.<p>.

Megatron fuses QKV per query group (rows [ng, np/ng + 2, hn]: the group's query heads, its key
head, its value head), so splitting the groups gives Llama's grouped-query order. An
interleaved-rotary checkpoint has its q/k rows permuted into Llama's rotate-half layout.

Needs the [eval] extra (transformers, safetensors): only export-hf and import-hf import it.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Optional

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE
from tqdm import tqdm
from transformers import LlamaConfig, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import (
    SentencePieceExtractor,
    TikTokenConverter,
    import_protobuf,
)

from megatron_ext.conversion.common import ConversionError, resize_rows
from megatron_ext.conversion.hf_leviathan import LeviathanConfig
from megatron_ext.conversion.hf_leviathan.remote_code import AUTO_MAP
from megatron_ext.data.tokenizers import (
    EXPORT_PROVENANCE_FILE,
    GPT2BPETokenizer,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
)

__all__ = [
    "LEV_CONFIG_FIELDS",
    "LEVIATHAN_ARCHITECTURE",
    "LLAMA_ARCHITECTURE",
    "hf_config",
    "to_hf_state_dict",
    "from_hf_state_dict",
    "read_hf_checkpoint",
    "write_safetensors",
    "export_tokenizer",
    "check_llama_like",
]

logger = logging.getLogger(__name__)

LLAMA_ARCHITECTURE = "LlamaForCausalLM"
LEVIATHAN_ARCHITECTURE = "LeviathanForCausalLM"
LEV_CONFIG_FIELDS = (
    "num_digits",
    "base",
    "seed_dim",
    "num_knots",
    "rank",
    "num_heads",
    "temperature",
    "codebook_combine",
    "normalize_basis",
    "norm_eps",
    "product_eps",
    "init_std",
    "spline_init_std",
)
"""`LEVConfig` fields a `LeviathanConfig` stores, as `lev_<field>` (the model's definition and
its initialisation; the kernel, dedup and optimizer choices are the training run's)."""
_LEV_PREFIX = ("embedding.word_embeddings.", "model.embed_tokens.")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_SIMPLE = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def _interleaved_to_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from interleaved (x0, y0, x1, y1, ...) to rotate-half order."""
    hn = w.size(0) // heads
    return w.view(heads, hn // 2, 2, -1).transpose(1, 2).reshape(w.shape)


def split_qkv(qkv: torch.Tensor, heads: int, groups: int, rotary_interleaved: bool = False):
    """Megatron's fused [ng * (np/ng + 2) * hn, D] -> (q [np*hn, D], k [ng*hn, D], v)."""
    per = heads // groups
    hn = qkv.size(0) // (groups * (per + 2))
    grouped = qkv.view(groups, per + 2, hn, -1)
    q = grouped[:, :per].reshape(heads * hn, -1)
    k = grouped[:, per].reshape(groups * hn, -1)
    v = grouped[:, per + 1].reshape(groups * hn, -1)
    if rotary_interleaved:
        q, k = _interleaved_to_half(q, heads), _interleaved_to_half(k, groups)
    return q.contiguous(), k.contiguous(), v.contiguous()


def fuse_qkv(q, k, v, heads: int, groups: int):
    """Inverse of `split_qkv` (q and k rows in rotate-half order, as Llama's)."""
    per = heads // groups
    hn = q.size(0) // heads
    parts = [q.view(groups, per, hn, -1), k.view(groups, 1, hn, -1), v.view(groups, 1, hn, -1)]
    return torch.cat(parts, dim=1).reshape(-1, q.size(-1)).contiguous()


def to_hf_state_dict(
    full: dict[str, torch.Tensor],
    input_table: Optional[torch.Tensor],
    *,
    num_attention_heads: int,
    num_query_groups: int,
    tied: bool,
    vocab_rows: int,
    rotary_interleaved: bool = False,
) -> dict[str, torch.Tensor]:
    """Our full state dict (input module replaced by `input_table` [Vp, D]) -> Llama names,
    `vocab_rows` rows of the table and head kept; with `input_table` None LEV's parameters stay
    as they are under model.embed_tokens (`LeviathanForCausalLM`)."""
    out: dict[str, torch.Tensor] = {}
    if input_table is not None:
        out["model.embed_tokens.weight"] = input_table[:vocab_rows]
    for name, tensor in full.items():
        match = _LAYER.match(name)
        if match:
            i, rest = match.groups()
            prefix = f"model.layers.{i}."
            if rest in _SIMPLE:
                out[prefix + _SIMPLE[rest]] = tensor
            elif rest == "self_attention.linear_qkv.weight":
                q, k, v = split_qkv(
                    tensor, num_attention_heads, num_query_groups, rotary_interleaved
                )
                out[prefix + "self_attn.q_proj.weight"] = q
                out[prefix + "self_attn.k_proj.weight"] = k
                out[prefix + "self_attn.v_proj.weight"] = v
            elif rest == "mlp.linear_fc1.weight":
                gate, up = tensor.chunk(2, dim=0)
                out[prefix + "mlp.gate_proj.weight"] = gate.contiguous()
                out[prefix + "mlp.up_proj.weight"] = up.contiguous()
            else:
                raise ConversionError(f"no Hugging Face Llama counterpart for {name}")
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = tensor
        elif name == "output_layer.weight":
            if not tied:
                out["lm_head.weight"] = tensor[:vocab_rows]
        elif input_table is None and name.startswith(_LEV_PREFIX[0]):
            out[_LEV_PREFIX[1] + name[len(_LEV_PREFIX[0]) :]] = tensor
        elif not name.startswith("embedding."):
            raise ConversionError(f"no Hugging Face Llama counterpart for {name}")
    return out


def from_hf_state_dict(
    hf: dict[str, torch.Tensor],
    *,
    num_attention_heads: int,
    num_query_groups: int,
    tied: bool,
    padded_vocab: int,
    lev: bool = False,
) -> dict[str, torch.Tensor]:
    """Llama names -> our full state dict for the TIED or UNTIED arm, or with `lev` the LEV arm
    (`LeviathanForCausalLM`), the vocabulary padded with zero rows to `padded_vocab`."""

    def pad(t: torch.Tensor) -> torch.Tensor:
        if t.size(0) > padded_vocab:
            raise ConversionError(f"vocabulary {t.size(0)} exceeds the padded size {padded_vocab}")
        return resize_rows(t, padded_vocab)

    if lev:
        n = len(_LEV_PREFIX[1])
        out = {_LEV_PREFIX[0] + k[n:]: v for k, v in hf.items() if k.startswith(_LEV_PREFIX[1])}
    else:
        out = {"embedding.word_embeddings.weight": pad(hf["model.embed_tokens.weight"])}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in hf.items():
        match = _HF_LAYER.match(name)
        if match:
            layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    inverse = {v: k for k, v in _SIMPLE.items()}
    for i in sorted(layers):
        layer = layers[i]
        prefix = f"decoder.layers.{i}."
        for hf_name, ours in inverse.items():
            out[prefix + ours] = layer[hf_name]
        out[prefix + "self_attention.linear_qkv.weight"] = fuse_qkv(
            layer["self_attn.q_proj.weight"],
            layer["self_attn.k_proj.weight"],
            layer["self_attn.v_proj.weight"],
            num_attention_heads,
            num_query_groups,
        )
        out[prefix + "mlp.linear_fc1.weight"] = torch.cat(
            [layer["mlp.gate_proj.weight"], layer["mlp.up_proj.weight"]]
        )
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not tied:
        head = hf.get("lm_head.weight")
        out["output_layer.weight"] = pad(
            head if head is not None else hf["model.embed_tokens.weight"]
        )
    return out


def hf_config(
    model_config,
    *,
    vocab_size: int,
    tied: bool,
    dtype: torch.dtype,
    tokenizer=None,
    provenance: Optional[dict] = None,
    lev_config=None,
):
    """The `LlamaConfig` of an exported model, or with `lev_config` (a `LEVConfig`) the
    `LeviathanConfig` with its `lev_*` fields and `auto_map`; `provenance` is stored as
    `leviathan`."""
    eod = getattr(tokenizer, "eod", None)
    pad = getattr(tokenizer, "pad", None)
    extra: dict = {"architectures": [LLAMA_ARCHITECTURE]}
    config_class = LlamaConfig
    if lev_config is not None:
        config_class = LeviathanConfig
        extra = {f"lev_{k}": getattr(lev_config, k) for k in LEV_CONFIG_FIELDS}
        extra["architectures"] = [LEVIATHAN_ARCHITECTURE]
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=model_config.hidden_size,
        intermediate_size=model_config.ffn_hidden_size,
        num_hidden_layers=model_config.num_layers,
        num_attention_heads=model_config.num_attention_heads,
        num_key_value_heads=model_config.num_query_groups,
        head_dim=model_config.kv_channels,
        hidden_act="silu",
        max_position_embeddings=model_config.seq_length,
        rms_norm_eps=model_config.norm_epsilon,
        rope_theta=float(model_config.rotary_base),
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=tied,
        # Documents were trained as EOD-separated streams: the EOD id is what starts one, so
        # harnesses that prefix scored text with BOS (lm-eval's `hf`) use what training did.
        bos_token_id=eod,
        eos_token_id=eod,
        pad_token_id=pad,
        **extra,
    )
    config.dtype = dtype
    if lev_config is not None:
        config.auto_map = dict(AUTO_MAP)
    if provenance is not None:
        config.leviathan = provenance
    return config


def check_llama_like(config: dict, path: str) -> None:
    """Refuse a config.json that our TIED/UNTIED (or, for a `LeviathanForCausalLM`, LEV) model
    cannot represent, naming the reason."""
    arch = config.get("architectures") or []
    reasons = []
    known = config.get("model_type") in ("llama", "leviathan")
    if not known and not {LLAMA_ARCHITECTURE, LEVIATHAN_ARCHITECTURE} & set(arch):
        reasons.append(f"model_type {config.get('model_type')!r} / architectures {arch}")
    if config.get("attention_bias") or config.get("mlp_bias"):
        reasons.append("linear biases")
    if config.get("hidden_act", "silu") != "silu":
        reasons.append(f"hidden_act {config.get('hidden_act')}")
    rope = config.get("rope_scaling") or {}
    params = config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type") or rope.get("type") or params.get("rope_type", "default")
    if rope_type not in ("default", None):
        reasons.append(f"rope scaling {rope_type}")
    head_dim = config.get("head_dim")
    if head_dim and head_dim * config["num_attention_heads"] != config["hidden_size"]:
        reasons.append("head_dim x heads != hidden_size")
    if reasons:
        raise ConversionError(
            f"{path} is not a Llama-like model this project can import ({'; '.join(reasons)}); "
            "import-hf takes LlamaForCausalLM and LeviathanForCausalLM checkpoints"
        )


def read_hf_checkpoint(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json as a dict, every tensor) of a Hugging Face model directory."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ConversionError(f"{path} has no config.json; give a Hugging Face model directory")
    with open(config_path) as handle:
        config = json.load(handle)
    check_llama_like(config, path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as handle:
            files = sorted(set(json.load(handle)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ConversionError(
            f"{path} has no model.safetensors(.index.json); save the model with "
            "save_pretrained(safe_serialization=True)"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ConversionError(f"{path} is missing shard file {name} listed in its index")
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                tensors[key] = handle.get_tensor(key)
    return config, tensors


def write_safetensors(
    state: dict[str, torch.Tensor],
    out_dir: str,
    *,
    max_shard_size: str | int = "5GB",
    progress: bool = True,
) -> list[str]:
    """Write `state` as model.safetensors, or shards plus model.safetensors.index.json."""
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    names = []
    for filename, keys in tqdm(
        split.filename_to_tensors.items(),
        desc="writing safetensors",
        unit="file",
        disable=not progress,
    ):
        shard = {k: state[k].contiguous() for k in keys}
        path = os.path.join(out_dir, filename)
        save_file(shard, path, metadata={"format": "pt"})
        os.chmod(path, 0o666 & ~_umask())  # safetensors creates files 0600
        names.append(filename)
    if split.is_sharded:
        index = {
            "metadata": {"total_size": split.metadata["total_size"]},
            "weight_map": split.tensor_to_filename,
        }
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as handle:
            json.dump(index, handle, indent=2, sort_keys=True)
    return names


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def export_tokenizer(tokenizer, out_dir: str) -> None:
    """Write tokenizer files that `AutoTokenizer.from_pretrained(out_dir)` loads and that encode
    as `tokenizer` does: a SentencePiece BPE or a tiktoken / GPT-2 rank file as a `tokenizers`
    BPE, a Hugging Face tokenizer as it is."""
    if isinstance(tokenizer, HuggingFaceTokenizer):
        tokenizer._tok.save_pretrained(out_dir)
    elif isinstance(tokenizer, SentencePieceTokenizer):
        _export_sentencepiece(tokenizer, out_dir)
    elif isinstance(tokenizer, TikTokenizer):
        _export_tiktoken(tokenizer, out_dir)
    elif isinstance(tokenizer, GPT2BPETokenizer):
        _export_gpt2_bpe(tokenizer, out_dir)
    else:
        raise ConversionError(
            f"cannot export a {type(tokenizer).__name__} as a Hugging Face tokenizer; pass "
            "--no-tokenizer and supply tokenizer files yourself"
        )
    # The exported files map text to the source's ids, so datasets and checkpoints made with
    # the source keep matching (data/fingerprint.py) as long as these files are unchanged.
    provenance = {
        "source_fingerprint": tokenizer.fingerprint,
        "source_type": tokenizer.type_name,
        # computed before the record exists, so it is the files' own fingerprint
        "exported_fingerprint": HuggingFaceTokenizer(out_dir).fingerprint,
    }
    with open(os.path.join(out_dir, EXPORT_PROVENANCE_FILE), "w") as handle:
        json.dump(provenance, handle, indent=1, sort_keys=True)
        handle.write("\n")


# Text the exported tokenizer must encode exactly as the source: words, digits, whitespace runs,
# punctuation, accents, CJK, emoji, and special-token text (ordinary text in documents).
_TOKENIZER_PROBE = (
    "The history of the river, a café and 東京 in 2026: 1234567 items!\n\n  Indented\tline "
    "don't WE'LL see émoji 🎉🎉 — <|endoftext|> naïve   spaces\r\nend."
)


def _export_tiktoken(tokenizer: TikTokenizer, out_dir: str) -> None:
    """A tiktoken encoding as a `tokenizers` byte-level BPE: its rank file's tokens at their
    ranks (the merges derived from the ranks, as transformers' TikTokenConverter does), its
    split pattern, and its special tokens at their ids, never matched in text (the source
    encodes documents with `encode_ordinary`). Checked on a probe text before it is kept."""
    encoding = tokenizer._enc
    vocab, merges = TikTokenConverter(
        vocab_file=tokenizer.model_path
    ).extract_vocab_merges_from_model(tokenizer.model_path)
    specials = {t: encoding.encode_single_token(t) for t in encoding.special_tokens_set}
    backend = Tokenizer(BPE({**vocab, **specials}, merges, fuse_unk=False))
    backend.model.ignore_merges = True  # tiktoken takes a whole piece found in its ranks
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(tokenizer.split_pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    eod = encoding.decode_single_token_bytes(tokenizer.eod).decode()
    pad = tokenizer.pad
    pad = None if pad is None else encoding.decode_single_token_bytes(pad).decode()
    _save_fast(
        backend, tokenizer, out_dir, eod, pad, probe="this tiktoken encoding (its split pattern?)"
    )


def _export_gpt2_bpe(tokenizer: GPT2BPETokenizer, out_dir: str) -> None:
    """GPT-2 vocab.json + merges.txt as a `tokenizers` byte-level BPE with GPT-2's split
    pattern; <|endoftext|> (EOD) at its id, never matched in text (as Megatron-LM's
    GPT2BPETokenizer). Checked on a probe text before it is kept."""
    backend = Tokenizer(BPE.from_file(tokenizer.model_path, tokenizer.merge_file))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    eod = tokenizer.detokenize([tokenizer.eod])
    backend.add_special_tokens([AddedToken(eod, special=True, normalized=False)])
    _save_fast(backend, tokenizer, out_dir, eod, None, probe="these GPT-2 files")


def _save_fast(backend, tokenizer, out_dir: str, eod, pad, unk=None, probe=None) -> None:
    """`backend` as a transformers fast tokenizer in `out_dir` under the generic class name
    every transformers release (and vLLM, lm-eval) knows; BOS and EOS are the end-of-document
    token `eod` (what training starts a document with: a scoring prefix, never added to encoded
    text). `probe` (what the source is): kept only once it encodes a probe text as `tokenizer`.
    """
    fast = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=unk,
        bos_token=eod,
        eos_token=eod,
        pad_token=pad,
        split_special_tokens=True,  # special tokens are never matched in text, as in training
        clean_up_tokenization_spaces=False,
    )
    encoded = fast(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"] if probe else None
    if probe is not None and encoded != tokenizer.tokenize(_TOKENIZER_PROBE):
        raise ConversionError(
            f"{tokenizer.model_path}: the Hugging Face byte-level BPE does not encode like "
            f"{probe}; pass --no-tokenizer"
        )
    fast.save_pretrained(out_dir)
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    with open(config_path) as handle:
        config = json.load(handle)
    config.update(
        tokenizer_class="PreTrainedTokenizerFast", add_bos_token=False, add_eos_token=False
    )
    with open(config_path, "w") as handle:
        json.dump(config, handle, indent=2, sort_keys=True)


def _export_sentencepiece(tokenizer, out_dir: str) -> None:
    model_path = tokenizer.model_path
    proto = import_protobuf().ModelProto()
    with open(model_path, "rb") as handle:
        proto.ParseFromString(handle.read())
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    problems = []
    if spec.model_type != 2:
        problems.append("not a BPE model (train it with --model-type bpe)")
    if norm.name not in ("identity", "") or norm.precompiled_charsmap:
        problems.append(f"normalisation {norm.name!r} (train with identity normalisation)")
    if norm.remove_extra_whitespaces:
        problems.append("remove_extra_whitespaces")
    if problems:
        raise ConversionError(
            f"{model_path}: cannot reproduce this SentencePiece model exactly as a Hugging Face "
            f"tokenizer ({'; '.join(problems)}); pass --no-tokenizer"
        )
    extracted = SentencePieceExtractor(model_path).extract(BPE)
    sp = tokenizer._sp

    def piece(i: int) -> Optional[str]:
        return sp.IdToPiece(i) if 0 <= i < sp.GetPieceSize() else None

    unk = piece(sp.unk_id())
    backend = Tokenizer(
        BPE(
            vocab=extracted["vocab"],
            merges=extracted["merges"],
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=spec.byte_fallback,
        )
    )
    steps = [normalizers.Replace(" ", "\u2581")]
    if norm.add_dummy_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    backend.normalizer = normalizers.Sequence(steps)
    strip = [decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else []
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )
    _save_fast(backend, tokenizer, out_dir, piece(tokenizer.eod), piece(sp.pad_id()), unk)
