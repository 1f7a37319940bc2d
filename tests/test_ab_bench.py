"""bench/ab.py on CPU: variants parse into switches, which are applied and then restored exactly."""
import pytest

import lora
import lora_kernels
import marlin_kernel
import paged_attention
import sampling
from test_step_bench import load_bench


def test_variants_switch_the_flags_and_restore_them():
    ab = load_bench("ab")
    before = (marlin_kernel.PDL, marlin_kernel.REDUCE_IN_KERNEL, paged_attention.MERGE_MAX_PARTS,
              lora._decode_kernels, sampling.triton)
    variant = ab.parse_variant("pdl=0,reduce=0,merge=0,lora_kernels=0,sampler=torch")
    assert variant == dict(pdl="0", reduce="0", merge="0", lora_kernels="0", sampler="torch")
    with ab.switched(variant):
        assert marlin_kernel.PDL is False and marlin_kernel.REDUCE_IN_KERNEL is False
        assert paged_attention.MERGE_MAX_PARTS == 0 and sampling.triton is None
        assert lora._decode_kernels is not before[3] and lora._decode_kernels(None) is False
    assert (marlin_kernel.PDL, marlin_kernel.REDUCE_IN_KERNEL, paged_attention.MERGE_MAX_PARTS,
            lora._decode_kernels, sampling.triton) == before
    with ab.switched(ab.parse_variant("lora_pdl_nvfp4=1")):
        assert lora_kernels.PDL_BESIDE_NVFP4 is True
    assert lora_kernels.PDL_BESIDE_NVFP4 is False
    with ab.switched(ab.parse_variant("merge=64")):
        assert paged_attention.MERGE_MAX_PARTS == 64 and marlin_kernel.PDL == before[0]
    assert paged_attention.MERGE_MAX_PARTS == before[2]
    kernel_flags = (marlin_kernel.LONG_RUN_WINDOWS, marlin_kernel.FRAGMENT_REDUCE_MAX_M,
                    marlin_kernel.FRAGMENT_LATE_RELEASE)
    with ab.switched(ab.parse_variant("long_run=999,frag_reduce=8,frag_late=2")):
        assert (marlin_kernel.LONG_RUN_WINDOWS, marlin_kernel.FRAGMENT_REDUCE_MAX_M,
                marlin_kernel.FRAGMENT_LATE_RELEASE) == (999, 8, 2)
    assert (marlin_kernel.LONG_RUN_WINDOWS, marlin_kernel.FRAGMENT_REDUCE_MAX_M,
            marlin_kernel.FRAGMENT_LATE_RELEASE) == kernel_flags


def test_a_bad_switch_names_the_known_ones():
    ab = load_bench("ab")
    for text in ("pld=0", "pdl", "reduce=1,bogus=2"):
        with pytest.raises(ValueError, match="merge"):
            ab.parse_variant(text)
