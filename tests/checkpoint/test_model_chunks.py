"""Checkpoint keys of model chunks (virtual pipeline stages): a rank's chunks, given as a list or
a ModuleList, are named like the single-stage model (each layer by its global `layer_number`),
the last rank's tied head copy is recognised in its chunk, and the arm check reads the first
chunk. The launched save/resume runs are in test_end_to_end.py."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ext.checkpoint import format as ck


class _Layer(torch.nn.Module):
    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number  # megatron-core's global, 1-based layer number
        self.weight = torch.nn.Parameter(torch.full((2,), float(layer_number)))


class _Decoder(torch.nn.Module):
    def __init__(self, layer_numbers) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(n) for n in layer_numbers)


class _Chunk(torch.nn.Module):
    """The parameter layout of a megatron-core GPT chunk (embedding on the first, head on the
    last virtual stage; a tied head has share_embeddings_and_output_weights)."""

    def __init__(self, layer_numbers, pre: bool, post: bool, tied: bool) -> None:
        super().__init__()
        self.pre_process, self.share_embeddings_and_output_weights = pre, tied
        self.embedding_type = "tied" if tied else "untied"
        if pre:
            self.embedding = torch.nn.Module()
            self.embedding.word_embeddings = torch.nn.Linear(2, 3, bias=False)
        self.decoder = _Decoder(layer_numbers)
        if post:
            self.output_layer = torch.nn.Linear(2, 3, bias=False)


def _keys(model) -> list[tuple[str, bool]]:
    return [(key, tied) for _, key, _, tied in ck._named_params(model)]


@pytest.mark.parametrize("as_module_list", [False, True], ids=["list", "ModuleList"])
def test_chunk_keys_are_the_single_stage_names(as_module_list):
    # PP=2 x 2 chunks of one layer: rank 0 holds virtual stages 0 and 2 (layers 1 and 3).
    rank0 = [_Chunk([1], pre=True, post=False, tied=True), _Chunk([3], False, False, True)]
    rank1 = [_Chunk([2], pre=False, post=False, tied=True), _Chunk([4], False, True, True)]
    if as_module_list:
        rank0, rank1 = torch.nn.ModuleList(rank0), torch.nn.ModuleList(rank1)
    assert _keys(rank0) == [
        ("embedding.word_embeddings.weight", False),
        ("decoder.layers.0.weight", False),
        ("decoder.layers.2.weight", False),
    ]
    assert _keys(rank1) == [
        ("decoder.layers.1.weight", False),
        ("decoder.layers.3.weight", False),
        ("embedding.word_embeddings.weight", True),  # the tied copy: loaded, never saved
    ]
    params = {key: p for _, key, p, tied in ck._named_params(rank1) if not tied}
    assert params["decoder.layers.3.weight"].detach()[0].item() == 4.0  # the layer behind the key


def test_one_module_is_one_chunk():
    model = _Chunk([1, 2], pre=True, post=True, tied=False)
    assert [key for key, _ in _keys(model)] == [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.weight",
        "decoder.layers.1.weight",
        "output_layer.weight",
    ]
    assert _keys(model) == _keys([model]) == _keys(torch.nn.ModuleList([model]))


def test_arm_check_reads_the_first_chunk(tmp_path):
    (tmp_path / "args.json").write_text(json.dumps({"embedding_type": "lev"}))
    chunks = torch.nn.ModuleList([_Chunk([1], True, False, True), _Chunk([3], False, False, True)])
    with pytest.raises(ck.CheckpointError, match="--embedding-type lev model, but this run"):
        ck._check_same_arm(str(tmp_path), chunks)
