"""``ltx_mgpu.finite``: the load-time check finds every NaN and infinity of every float dtype a file
holds (float8 through its byte codes: positive and negative NaN, e5m2's infinities), never
flags a finite value (the extremes of each dtype included), and names the first bad tensor of
many read back at once."""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.finite import FiniteCheck, is_finite, nonfinite

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
#: Every float8 e4m3fn / e5m2 byte that is a NaN or an infinity (OCP 8-bit floating point).
BAD_CODES = {torch.float8_e4m3fn: {0x7F, 0xFF}, torch.float8_e5m2: {0x7C, 0x7D, 0x7E, 0x7F, 0xFC, 0xFD, 0xFE, 0xFF}}


@pytest.mark.parametrize("dtype", FLOATS)
def test_nan_and_infinities_are_found_and_the_extremes_are_finite(dtype):
    t = torch.randn(33, 17).to(dtype)
    t[0, 0], t[0, 1] = torch.finfo(dtype).max, torch.finfo(dtype).min
    assert is_finite(t)
    for value in (float("nan"), float("inf"), float("-inf")):
        bad = t.clone()
        bad[20, 9] = value
        assert not is_finite(bad), value


@pytest.mark.parametrize("dtype", list(BAD_CODES))
def test_every_float8_code_is_classified_as_the_format_defines_it(dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for code in range(256):
        t = torch.zeros(8, dtype=torch.uint8)
        t[5] = code
        assert is_finite(t.view(dtype)) == (code not in BAD_CODES[dtype]), hex(code)
    assert torch.isnan(codes.view(dtype).float()).logical_or(torch.isinf(codes.view(dtype).float())).nonzero() \
        .flatten().tolist() == sorted(BAD_CODES[dtype])  # torch's own decoding agrees


def test_integers_and_empty_tensors_need_no_check():
    assert nonfinite(torch.arange(5)) is None and nonfinite(torch.zeros(0)) is None
    assert is_finite(torch.tensor([True]))


def test_the_first_bad_tensor_of_many_is_named():
    check = FiniteCheck()
    good, bad = torch.ones(4), torch.ones(4)
    bad[2] = float("nan")
    for name, t in (("a", good), ("n", torch.arange(3)), ("b", bad), ("c", bad)):
        check.add(name, t)
    assert check.first() == "b"
    assert check.first() is None  # emptied
    check.add("a", good)
    assert check.first() is None
