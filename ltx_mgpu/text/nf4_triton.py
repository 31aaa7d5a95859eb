"""NF4 dequantization as one Triton kernel (the ``"triton"`` method of ``nf4_dequant``).

bitsandbytes' ``dequantize_4bit`` ran at 867 GB/s (bytes read + written) on an H200 for a Gemma 3
12B decoder layer (224 M weights: 0.65 ms), 48 times per forward: at 1x1024 tokens that is 31 ms
on top of a 66 ms bf16 encode. The work is a streaming map (read 0.5 B, write 2 B per weight),
so the kernel here does exactly that: each program reads ``BLOCK`` packed bytes, looks both
nibbles up in the 16-entry NF4 code table, multiplies by the block's scale and writes the bf16
pair. Same arithmetic as bitsandbytes (a float32 ``code[q] * absmax`` rounded once to bf16,
element ``2i`` from the high nibble; ``../shared/notes/gemma-nf4.md`` §5), so the output is
bit-identical; the double-quantized block scales are first dequantized with the torch ops of
:func:`ltx_mgpu.text.nf4_dequant.dequantize_absmax` (also bit-identical, one small tensor).
"""

from __future__ import annotations

import functools

import torch

#: Packed bytes per Triton program (2 * BLOCK weights).
BLOCK = 1024


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def nf4_dequant(packed_ptr, absmax_ptr, code_ptr, out_ptr, n_bytes, bytes_per_block: tl.constexpr,
                    BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_bytes
        b = tl.load(packed_ptr + offs, mask=mask, other=0).to(tl.int32)
        scale = tl.load(absmax_ptr + offs // bytes_per_block, mask=mask, other=0.0)
        hi = tl.load(code_ptr + (b >> 4)) * scale
        lo = tl.load(code_ptr + (b & 15)) * scale
        pair = tl.reshape(tl.join(hi, lo), [2 * BLOCK])
        out_offs = pid * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
        tl.store(out_ptr + out_offs, pair.to(tl.bfloat16), mask=out_offs < 2 * n_bytes)

    return nf4_dequant


def available() -> bool:
    """Whether the kernel can run here (Triton importable and a CUDA device)."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def dequantize_nf4_triton(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                          out: torch.Tensor) -> torch.Tensor:
    """Dequantize NF4 bytes into ``out``.

    Args:
        packed: uint8, ``n/2`` bytes (bitsandbytes ``Params4bit`` data, any shape), on CUDA.
        absmax: float32 ``[n / blocksize]`` block scales (already dequantized).
        code: float32 ``[16]`` NF4 code table (``quant_state.code``).
        blocksize: weights per scale (64 in ltx_mgpu artifacts; even).
        out: bf16 with ``n`` elements, contiguous, on the same device.

    Returns:
        ``out``.

    Raises:
        ValueError: mismatched sizes, dtypes or devices.
    """
    n_bytes = packed.numel()
    if out.numel() != 2 * n_bytes or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bf16 tensor of {2 * n_bytes} elements, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if blocksize % 2 or absmax.numel() * blocksize < 2 * n_bytes or absmax.dtype != torch.float32:
        raise ValueError(f"absmax must be float32 with one scale per {blocksize} weights")
    if not (packed.is_cuda and absmax.device == packed.device and out.device == packed.device):
        raise ValueError("packed, absmax and out must be on one CUDA device")
    grid = (triton_cdiv(n_bytes, BLOCK),)
    _kernel()[grid](packed, absmax, code.to(device=packed.device, dtype=torch.float32), out, n_bytes,
                    bytes_per_block=blocksize // 2, BLOCK=BLOCK)
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
