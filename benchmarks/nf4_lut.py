"""The byte-LUT NF4 dequant: a measurement arm of ``bench_nf4.py``, not product code.

A ``[256, 2]`` float32 table whose row ``b`` holds ``(code[b >> 4], code[b & 15])`` (element 2i
is the high nibble), so one gather per packed byte yields both values, times the block's scale.
Bit-exact with bitsandbytes (float32 table and multiply, then one rounding to bf16). Eager, it
materialises int32 indices and float32 values (about 10 B of memory traffic per weight);
compiled (``torch.compile``: Inductor fuses the scale dequant, the gather, the multiply and the
bf16 store) it reads 0.5 + 1/64 B and writes 2 B per weight, and a whole unit is one compiled
call. The product's kernels are ``ltx_mgpu.text.nf4.dequant``'s (bitsandbytes, Triton); these
plug into its ``FastDequant`` through ``fill``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ltx_mgpu.text.nf4.dequant import UnitFill

__all__ = ["nf4_byte_lut", "dequantize_nf4_lut", "lut_fill"]


def nf4_byte_lut(code: torch.Tensor) -> torch.Tensor:
    """``[256, 2]`` table, row ``b`` = ``(code[b >> 4], code[b & 15])``, dtype/device of ``code``.

    Args:
        code: the 16 NF4 code values (``quant_state.code``, bitsandbytes index order).
    """
    b = torch.arange(256, device=code.device)
    return torch.stack((code[b >> 4], code[b & 15]), dim=1).contiguous()


def _absmax(absmax_u8: torch.Tensor, code8: torch.Tensor, nested: torch.Tensor, offset: torch.Tensor,
            nested_blocksize: int) -> torch.Tensor:
    idx = torch.arange(absmax_u8.numel(), device=absmax_u8.device) // nested_blocksize
    return code8[absmax_u8.long()] * nested[idx] + offset


def _lut(packed: torch.Tensor, absmax_u8: torch.Tensor, code8: torch.Tensor, nested: torch.Tensor,
         offset: torch.Tensor, lut: torch.Tensor, out: torch.Tensor, nested_blocksize: int) -> None:
    scale = _absmax(absmax_u8, code8, nested, offset, nested_blocksize)
    vals = lut.index_select(0, packed.reshape(-1).int())  # [n/2, 2]: one gather per byte
    out.copy_((vals.view(scale.numel(), -1) * scale[:, None]).view(out.shape))


@functools.lru_cache(maxsize=None)
def _compiled_lut():
    return torch.compile(_lut, dynamic=False, fullgraph=True)


def _lut_unit(weights: list, buf: torch.Tensor, spans: tuple, nested_blocksize: int) -> None:
    """Dequantize several weights into ``buf[start:start + n]`` (``spans``: static ints), one call."""
    for (packed, absmax_u8, code8, nested, offset, lut), (start, n) in zip(weights, spans):
        _lut(packed, absmax_u8, code8, nested, offset, lut, buf[start:start + n], nested_blocksize)


@functools.lru_cache(maxsize=None)
def _compiled_lut_unit():
    # one graph per unit layout (every Gemma decoder layer shares one), one guard check per call
    return torch.compile(_lut_unit, dynamic=False, fullgraph=True)


def _args(weight: Any, lut: torch.Tensor | None) -> tuple:
    qs = weight.quant_state
    shape = tuple(qs.shape)
    if not qs.nested or (shape[0] * shape[1]) % qs.blocksize:
        raise ValueError("the byte-LUT dequant needs double quantization and N*K divisible by the blocksize")
    lut = nf4_byte_lut(qs.code) if lut is None else lut
    return weight.data, qs.absmax, qs.state2.code, qs.state2.absmax, qs.offset, lut


def dequantize_nf4_lut(weight: Any, out: torch.Tensor | None = None, compiled: bool = False,
                       lut: torch.Tensor | None = None) -> torch.Tensor:
    """A double-quantized NF4 ``Params4bit`` dequantized to its ``[N, K]`` weight with the byte LUT
    (``compiled``: through ``torch.compile``); equal to bitsandbytes' dequantization.

    Raises:
        ValueError: no double quantization, or ``N*K`` not a multiple of the blocksize.
    """
    qs = weight.quant_state
    shape = tuple(qs.shape)
    out = (torch.empty(shape, dtype=qs.dtype, device=weight.device) if out is None else out).view(shape)
    fn = _compiled_lut() if compiled else _lut
    # flat output: compiled graphs are then keyed by the weight's size only (3 for Gemma 3 12B)
    fn(*_args(weight, lut), out.view(-1), qs.state2.blocksize)
    return out


def lut_fill(compiled: bool) -> UnitFill:
    """A ``FastDequant(fill=...)`` running the byte LUT: per weight (eager), or one compiled call per unit."""
    tables: dict[int, torch.Tensor] = {}

    def table(w: Any) -> torch.Tensor:
        key = id(w)
        if key not in tables:
            tables[key] = nf4_byte_lut(w.quant_state.code)  # [256, 2] float32, 2 KiB
        return tables[key]

    def fill(weights: list, views: list, buf: torch.Tensor) -> None:
        if not compiled:
            for w, v in zip(weights, views):
                dequantize_nf4_lut(w, v, lut=table(w))
            return
        spans, start = [], 0
        for v in views:
            spans.append((start, v.numel()))
            start += v.numel()
        args = [_args(w, table(w)) for w in weights]
        _compiled_lut_unit()(args, buf, tuple(spans), weights[0].quant_state.state2.blocksize)

    return fill
