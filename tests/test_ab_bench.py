"""bench/ab.py on CPU: variants parse into Tuning fields by the fields' types, apply through
tuning.using, and are restored exactly."""
import pytest

from kernels import tuning
from test_kernel_bench import load_bench


def test_variants_become_tuning_fields_and_are_restored():
    ab = load_bench("ab")
    before = tuning.current()
    variant = ab.parse_variant("pdl=0,reduce_in_kernel=false,merge_max_parts=0,wave_fill=0.5")
    assert variant == dict(pdl=False, reduce_in_kernel=False, merge_max_parts=0, wave_fill=0.5)
    assert type(variant["merge_max_parts"]) is int and type(variant["wave_fill"]) is float
    with ab.tuned(variant):
        t = tuning.current()
        assert (t.pdl, t.reduce_in_kernel, t.merge_max_parts, t.wave_fill) == (False, False, 0, 0.5)
        assert t.fused == before.fused and t.medium == before.medium
    assert tuning.current() is before
    with pytest.raises(RuntimeError):
        with ab.tuned(ab.parse_variant("merge_max_parts=64,long_run_windows=13,fragment_reduce_max_m=8")):
            assert (tuning.current().merge_max_parts, tuning.current().long_run_windows,
                    tuning.current().fragment_reduce_max_m) == (64, 13, 8)
            raise RuntimeError
    assert tuning.current() is before


def test_a_bad_field_names_the_known_ones():
    ab = load_bench("ab")
    for text in ("pld=0", "pdl", "reduce_in_kernel=1,bogus=2"):
        with pytest.raises(ValueError, match="merge_max_parts"):
            ab.parse_variant(text)
    with pytest.raises(ValueError, match="bool"):
        ab.parse_variant("pdl=yes")
    with pytest.raises(ValueError, match="dataclasses.replace"):
        ab.parse_variant("medium=1")


def test_fields_lists_every_field(capsys):
    load_bench("ab").main(["--fields"])
    out = capsys.readouterr().out
    assert all(name in out for name in ("pdl", "fused", "reduce_in_kernel", "partition_tokens", "sample_chunk"))
