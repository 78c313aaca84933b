"""The one sequence-split check that LEV, the digit-seed arm and the portable reduce-scatter use."""

import pytest

from megatron_ext.tensor_parallel import check_sequence_split


def test_sequence_split_names_the_flag_to_change():
    check_sequence_split(32, 4)
    with pytest.raises(
        ValueError, match="length 33 is not divisible by the tensor-parallel size 2"
    ):
        check_sequence_split(33, 2)
    with pytest.raises(ValueError, match="change --seq-length"):
        check_sequence_split(5, 4)
