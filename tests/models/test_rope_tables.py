"""CachedSelfAttention's rotary embedding (cos/sin tables reused, fewer passes) must give
megatron's own `apply_rotary_pos_emb` results bit for bit."""

import megatron_ext.megatron_import  # noqa: F401

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

from megatron_ext.models.local_modules import _RopeTables, _rotate


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot_dim", [16, 12])  # 12 < head dim 16: the rest passes through
def test_rotate_equals_megatron(interleaved, rot_dim):
    torch.manual_seed(0)
    t = torch.randn(7, 3, 4, 16)  # [s, b, n, hn]
    freqs = torch.rand(7, 1, 1, rot_dim) * 50
    expected = _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)
    cos, sin = _RopeTables.get(freqs, t.dtype, 1.0)
    assert torch.equal(_rotate(t, cos, sin, interleaved), expected)
    # A decoding step rotates one position with a slice of the same tables.
    step = _apply_rotary_pos_emb_bshd(t[4:5], freqs[4:5], rotary_interleaved=interleaved)
    assert torch.equal(_rotate(t[4:5], cos[4:5], sin[4:5], interleaved), step)


def test_tables_reused_per_angle_tensor_and_mode():
    freqs = torch.rand(5, 1, 1, 8)
    first = _RopeTables.get(freqs, torch.float32, 1.0)
    assert _RopeTables.get(freqs, torch.float32, 1.0)[0] is first[0]
    assert _RopeTables.get(freqs.clone(), torch.float32, 1.0)[0] is not first[0]
    with torch.inference_mode():
        inside = _RopeTables.get(freqs, torch.float32, 1.0)
    assert inside[0] is not first[0] and inside[0].is_inference()
    assert not _RopeTables.get(freqs, torch.float32, 1.0)[0].is_inference()
