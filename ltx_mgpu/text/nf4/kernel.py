"""NF4 dequantization of a whole unit of weights in one Triton kernel launch (the ``"triton"``
method of ``ltx_mgpu.text.nf4.dequant``; the loader's default on a GPU).

Why: at 1x1024 tokens an eager NF4 forward of Gemma 3 12B is bound by the host, not the GPU.
bitsandbytes' ``dequantize_4bit`` costs three kernel launches per weight (the 8-bit block scales,
the offset, the 4-bit values) plus its Python bookkeeping, 336 times per forward. Here one
launch dequantizes all 7 projections of a decoder layer, double-quantized scales included,
in a fraction of bitsandbytes' time per layer (``benchmarks/bench_nf4.py``, "dequant one
layer", measures both; bandwidth counted as packed bytes + scales read and bf16 written).

The arithmetic is bitsandbytes', step for step (``bitsandbytes.functional.dequantize_4bit``),
so the output is bit-identical:

* block scale ``s = code2[qabsmax[b]] * absmax2[b // blocksize2]`` (float32 multiply, the
  8-bit ``dequantize_blockwise``), then ``s = s + offset`` (a separate float32 add: the kernel
  is compiled with ``enable_fp_fusion=False`` so the two are never contracted into one FMA);
* weight pair of byte ``p``: ``code[p >> 4] * s`` and ``code[p & 15] * s`` in float32, each
  rounded once to bf16 (element ``2i`` from the high nibble).

The weights of a unit are addressed through a small table of device pointers (a grouped
launch: each program finds its weight from a table of first-program indices and converts a run
of :data:`BLOCKS` quantization blocks of it; the last run of a weight is masked at its end), so
nothing is copied or re-laid-out at load time.
Each program computes its blocks' scales once, then writes each packed byte's two bf16 values
as one 32-bit word (coalesced stores, no interleaving shuffle).
"""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Sequence

import torch

__all__ = ["BLOCKS", "NUM_WARPS", "available", "UnitDequant"]

#: Quantization blocks (64 weights, 32 packed bytes each) per Triton program, and warps per
#: program: chosen by a sweep of settings (``bench_nf4.py --dequant-sweep``). Alignment hints
#: (``tl.multiple_of`` on the addresses and sizes, for 16-byte vector loads and stores) gained
#: nothing and were not kept (``benchmarks/results/nf4_h200_sweep_aligned.log``).
BLOCKS = 32
NUM_WARPS = 2


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def nf4_unit_dequant(table_ptr, starts_ptr, offset_ptr, code_ptr, WEIGHTS: tl.constexpr,
                         BYTES_PER_BLOCK: tl.constexpr, BLOCKS_PER_NESTED: tl.constexpr, BLOCKS: tl.constexpr):
        # which weight this program belongs to: starts_ptr[i] = first program of weight i
        pid = tl.program_id(0)
        w = pid * 0
        for i in tl.static_range(1, WEIGHTS):
            w += (pid >= tl.load(starts_ptr + i)).to(tl.int32)
        local = pid - tl.load(starts_ptr + w)
        # the weight's row of the table: n_bytes, then the addresses of the packed bytes, the 8-bit
        # block scales, the nested float32 scales, the 256-entry scale code and the bf16 output
        row = table_ptr + w * 6
        n_bytes = tl.load(row)
        packed = tl.load(row + 1).to(tl.pointer_type(tl.uint8))
        qabsmax = tl.load(row + 2).to(tl.pointer_type(tl.uint8))
        nested = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        code2 = tl.load(row + 4).to(tl.pointer_type(tl.float32))
        out = tl.load(row + 5).to(tl.pointer_type(tl.uint32))  # bf16 pairs, element 2i in the low half
        offset = tl.load(offset_ptr + w)
        # one scale per 64-weight block, computed once per block (not per byte)
        blocks = local * BLOCKS + tl.arange(0, BLOCKS)
        live = blocks * BYTES_PER_BLOCK < n_bytes
        q = tl.load(qabsmax + blocks, mask=live, other=0).to(tl.int32)
        scale = tl.load(code2 + q) * tl.load(nested + blocks // BLOCKS_PER_NESTED, mask=live, other=0.0)
        scale = scale + offset
        offs = blocks[:, None] * BYTES_PER_BLOCK + tl.arange(0, BYTES_PER_BLOCK)[None, :]
        mask = offs < n_bytes
        b = tl.load(packed + offs, mask=mask, other=0).to(tl.int32)
        hi = (tl.load(code_ptr + (b >> 4)) * scale[:, None]).to(tl.bfloat16).to(tl.uint16, bitcast=True)
        lo = (tl.load(code_ptr + (b & 15)) * scale[:, None]).to(tl.bfloat16).to(tl.uint16, bitcast=True)
        tl.store(out + offs, (lo.to(tl.uint32) << 16) | hi.to(tl.uint32), mask=mask)

    return nf4_unit_dequant


def available() -> bool:
    """Whether the kernel can run here (Triton importable and a CUDA device)."""
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


class UnitDequant:
    """Dequantize several double-quantized NF4 weights into given bf16 tensors with one launch.

    Built once per (unit, output buffer) and called every forward; it holds device pointers, so
    the weights and outputs must stay allocated (and in place) while it is used.

    Args:
        weights: ``bitsandbytes.nn.Params4bit`` s (uint8 packed data, a ``quant_state`` with
            ``nested`` double quantization, blocksize 64, one device, one NF4 code table and
            one nested blocksize for all).
        outs: one contiguous, 4-byte-aligned bf16 tensor per weight with
            ``prod(quant_state.shape)`` elements, on the weights' device (e.g. views of one
            reused layer buffer).
        blocks, num_warps: quantization blocks per program (a power of two) and warps per
            program: launch tuning only, the output is the same (``benchmarks/bench_nf4.py
            --dequant-sweep`` times them).

    Raises:
        ValueError: no weights, a blocksize other than 64, a weight without double
            quantization, mixed devices, code tables, blocksizes or nested blocksizes, an
            output of the wrong size, dtype, layout, alignment or device, or ``blocks`` not a
            power of two. The checks run here, before any launch.
    """

    def __init__(self, weights: Sequence[Any], outs: Sequence[torch.Tensor], *, blocks: int = BLOCKS,
                 num_warps: int = NUM_WARPS) -> None:
        if blocks < 1 or blocks & (blocks - 1) or num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"blocks must be a power of two and num_warps one of 1, 2, 4, 8, 16; got {blocks}, "
                             f"{num_warps}")
        self.blocks, self.num_warps = int(blocks), int(num_warps)
        if not weights or len(weights) != len(outs):
            raise ValueError(f"need one output per weight, got {len(weights)} weights and {len(outs)} outputs")
        if weights[0].quant_state.blocksize != 64:
            raise ValueError(f"the Triton NF4 dequant takes blocksize 64 (ltx_mgpu's artifacts), got "
                             f"{weights[0].quant_state.blocksize}")
        first = weights[0].quant_state
        device = weights[0].device
        if device.type != "cuda":
            raise ValueError(f"the Triton NF4 dequant runs on CUDA; the weights are on {device}")
        rows, offsets = [], []
        self._keep: list[torch.Tensor] = []  # tensors the table points into that exist only here
        for w, out in zip(weights, outs):
            qs = w.quant_state
            if not getattr(qs, "nested", False):
                raise ValueError("the Triton NF4 dequant needs double quantization (compress_statistics=True)")
            if (qs.blocksize != first.blocksize or qs.blocksize % 2 or qs.state2.blocksize != first.state2.blocksize
                    or not torch.equal(qs.code, first.code)):
                raise ValueError("the weights of one unit must share the blocksize, nested blocksize and NF4 code")
            n = 1
            for d in qs.shape:
                n *= int(d)
            if (out.numel() != n or out.dtype != torch.bfloat16 or not out.is_contiguous() or out.device != device
                    or out.data_ptr() % 4 or w.device != device or w.data.numel() * 2 != n):
                raise ValueError(f"output for a {tuple(qs.shape)} NF4 weight must be a contiguous bf16 tensor of {n} "
                                 f"elements on {device}, 4-byte aligned; got {out.dtype} {tuple(out.shape)} on "
                                 f"{out.device}")
            code2 = qs.state2.code.to(device=device, dtype=torch.float32).contiguous()
            nested = qs.state2.absmax.to(torch.float32).contiguous()
            self._keep += [code2, nested]
            rows.append([n // 2, w.data.data_ptr(), qs.absmax.data_ptr(), nested.data_ptr(), code2.data_ptr(),
                         out.data_ptr()])
            offsets.append(qs.offset.reshape(1).to(device=device, dtype=torch.float32))
        self.table = torch.tensor(rows, dtype=torch.int64, device=device)
        per_program = self.blocks * (first.blocksize // 2)
        starts = [0]
        for r in rows:
            starts.append(starts[-1] + -(-r[0] // per_program))
        self.programs = starts[-1]
        self.starts = torch.tensor(starts, dtype=torch.int32, device=device)
        self.offsets = torch.cat(offsets)
        self.code = first.code.to(device=device, dtype=torch.float32).contiguous()
        self.bytes_per_block = first.blocksize // 2
        self.blocks_per_nested = first.state2.blocksize
        self.count = len(rows)

    def __call__(self) -> None:
        """Launch: every output now holds its weight's bf16 values (on the current stream)."""
        _kernel()[(self.programs,)](self.table, self.starts, self.offsets, self.code, WEIGHTS=self.count,
                                    BYTES_PER_BLOCK=self.bytes_per_block, BLOCKS_PER_NESTED=self.blocks_per_nested,
                                    BLOCKS=self.blocks, num_warps=self.num_warps, enable_fp_fusion=False)
