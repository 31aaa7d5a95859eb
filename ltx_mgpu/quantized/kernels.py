"""Triton kernels that dequantize a packed weight in one launch, straight into the compute dtype:
the GGML legacy 32-value blocks (``Q8_0``, ``Q4_0``, ``Q4_1``, ``Q5_0``, ``Q5_1``), the K-quant
super-blocks (``Q2_K`` ... ``Q6_K``), float8 e4m3 weights with a scale per row (the ``upcast``
of :mod:`ltx_mgpu.denoise.fp8`), and ComfyUI's nvfp4, mxfp8 and int8 (± ConvRot) layers as the
packed rows of :mod:`ltx_mgpu.quantized.rows`.

Why: dequantizing a weight with torch's eager operations takes one kernel per step (a K-quant
about twenty, each reading and writing float32 copies of the whole weight), and a packed model
dequantizes every block linear at every call. One launch that reads the packed bytes once and
writes the compute dtype once is bound by memory bandwidth (``benchmarks/bench_packed.py``
measures it).

The arithmetic is :func:`ltx_mgpu.quantized.ggml.dequantize`'s (``gguf.quants``' numpy
reference) operation by operation in float32, and the kernels are compiled with
``enable_fp_fusion=False``, so no multiply and add are contracted into one FMA: the float32
values are the same bits, and the cast to bf16 / fp16 rounds to nearest even as torch's does.
The e4m3 upcast is ``(w.float() * scale[:, None]).to(dtype)``, the same way. nvfp4 follows
comfy-kitchen's eager ``dequantize_nvfp4`` operation by operation in the output dtype (the two
scales multiplied and rounded, then the element; both products are exact before their one
rounding, as torch's are), so it gives the same bits; int8 is ``q * s`` and mxfp8 ``q * 2^e`` in
float32, then cast.
int8 with ConvRot computes ``q @ H`` on the tensor cores from fp16 operands (integers of at most
127 times ±1: exact products, sums below 2^24: exact in the float32 accumulator), then multiplies
by ``s / sqrt(g)`` (a power of two for the power-of-4 groups) and rounds once.

CUDA only; :func:`available` says whether it can run here. Callers fall back to the torch path.
"""

from __future__ import annotations

import importlib.util
import math

import torch

from ltx_mgpu.quantized.ggml import BLOCK_SHAPES

__all__ = ["GGML_KERNEL_TYPES", "available", "dequantize_ggml", "dequantize_int8_rows", "dequantize_mxfp8_rows",
           "dequantize_nvfp4_rows", "upcast_e4m3"]

#: The GGML types the kernels decode, by family: the value of the family's ``KIND`` switch.
_LEGACY = {"Q8_0": 0, "Q4_0": 1, "Q4_1": 2, "Q5_0": 3, "Q5_1": 4}
_K_QUANTS = {"Q4_K": 0, "Q5_K": 1, "Q6_K": 2, "Q2_K": 3, "Q3_K": 4}
GGML_KERNEL_TYPES = (*_LEGACY, *_K_QUANTS)
#: GGML blocks per program (legacy, K-quant), and warps per program.
_LEGACY_BLOCKS, _K_BLOCKS, _WARPS = 32, 4, 4
#: e4m3 upcast tile: rows x columns per program.
_UPCAST_ROWS, _UPCAST_COLS = 8, 256
#: ConvRot tiles: rows, output columns and the reduction step of the ``q @ H`` product per program.
_ROT_ROWS, _ROT_COLS, _ROT_K = 64, 64, 64
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available(device: torch.device | str | None = None) -> bool:
    """Whether the kernels can run on ``device`` (default: any CUDA device): Triton importable."""
    if not HAVE_TRITON or not torch.cuda.is_available():
        return False
    return device is None or torch.device(device).type == "cuda"


HAVE_TRITON = importlib.util.find_spec("triton") is not None

if HAVE_TRITON:  # the kernels are module-level functions: Triton resolves the helpers they call by name
    import triton
    import triton.language as tl

    @triton.jit
    def _half(p, live):
        """The little-endian fp16 at byte pointers ``p``, as float32."""
        lo = tl.load(p, mask=live, other=0).to(tl.uint16)
        hi = tl.load(p + 1, mask=live, other=0).to(tl.uint16)
        return ((hi << 8) | lo).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _byte(p, live):
        return tl.load(p, mask=live, other=0).to(tl.int32)

    @triton.jit
    def _legacy_blocks(src, out, n_blocks, KIND: tl.constexpr, SIZE: tl.constexpr, NB: tl.constexpr):
        b = tl.program_id(0).to(tl.int64) * NB + tl.arange(0, NB)
        live = b < n_blocks
        row = src + b * SIZE
        j = tl.arange(0, 32)
        both = live[:, None] & (j[None, :] < 32)
        d = _half(row, live)[:, None]
        if KIND == 0:  # Q8_0: d, 32 int8
            q = tl.load(row[:, None] + 2 + j[None, :], mask=both, other=0).to(tl.int8, bitcast=True)
            v = q.to(tl.float32) * d
        else:
            # the codes follow d, the minimum m (Q4_1, Q5_1) and the 32 fifth bits (Q5_0, Q5_1)
            if KIND == 1:
                at = 2
            elif KIND == 2:
                at = 4
            elif KIND == 3:
                at = 6
            else:
                at = 8
            qs = _byte(row[:, None] + at + (j[None, :] % 16), both)
            q = tl.where(j[None, :] < 16, qs & 15, qs >> 4)
            if KIND == 3 or KIND == 4:
                hp = row[:, None] + (at - 4)
                qh = _byte(hp, both) | (_byte(hp + 1, both) << 8)
                qh = qh | (_byte(hp + 2, both) << 16) | (_byte(hp + 3, both) << 24)
                q = q | (((qh >> j[None, :]) & 1) << 4)
            if KIND == 1:
                v = d * (q - 8).to(tl.float32)
            elif KIND == 3:
                v = d * (q - 16).to(tl.float32)
            else:  # Q4_1 / Q5_1: d * q + m
                v = d * q.to(tl.float32) + _half(row + 2, live)[:, None]
        tl.store(out + b[:, None] * 32 + j[None, :], v.to(out.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=both)

    @triton.jit
    def _k_blocks(src, out, n_blocks, KIND: tl.constexpr, SIZE: tl.constexpr, NB: tl.constexpr):
        b = tl.program_id(0).to(tl.int64) * NB + tl.arange(0, NB)
        live = b < n_blocks
        row = (src + b * SIZE)[:, None]
        j = tl.arange(0, 256)[None, :]
        both = live[:, None] & (j < 256)
        if KIND == 0 or KIND == 1:  # Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and minimums
            s = j // 32
            k = s % 4
            a, m, c = _byte(row + 4 + k, both), _byte(row + 8 + k, both), _byte(row + 12 + k, both)
            sc = tl.where(s < 4, a & 63, (c & 15) | ((a >> 6) << 4))
            mn = tl.where(s < 4, m & 63, (c >> 4) | ((m >> 6) << 4))
            i = j % 32
            if KIND == 0:
                qs = _byte(row + 16 + (s // 2) * 32 + i, both)
                q = tl.where(s % 2 == 0, qs & 15, qs >> 4)
            else:
                qs = _byte(row + 48 + (s // 2) * 32 + i, both)
                q = tl.where(s % 2 == 0, qs & 15, qs >> 4) | (((_byte(row + 16 + i, both) >> s) & 1) << 4)
            d = _half(row, both) * sc.to(tl.float32)
            dm = _half(row + 2, both) * mn.to(tl.float32)
            v = d * q.to(tl.float32) - dm
        elif KIND == 2:  # Q6_K: 128 bytes low nibbles, 64 bytes high pairs, 16 int8 scales, d
            r = j % 128
            g = j // 128
            ql = _byte(row + g * 64 + (j % 64), both)
            low = tl.where(r // 64 == 0, ql & 15, ql >> 4)
            high = (_byte(row + 128 + g * 32 + (j % 32), both) >> (2 * (r // 32))) & 3
            q = (low | (high << 4)) - 32
            sc = tl.load(row + 192 + j // 16, mask=both, other=0).to(tl.int8, bitcast=True).to(tl.float32)
            v = (_half(row + 208, both) * sc) * q.to(tl.float32)
        else:  # Q2_K / Q3_K: 2-bit codes in 64 bytes, four to a byte
            if KIND == 3:  # noqa: SIM108 - a branch of the compile-time KIND, as the others
                codes = 16
            else:
                codes = 32
            code = (_byte(row + codes + (j // 128) * 32 + (j % 32), both) >> (2 * ((j % 128) // 32))) & 3
            k = j // 16
            if KIND == 3:  # scales (low nibble) and minimums (high) per 16 values, d, dmin
                sm = _byte(row + k, both)
                dl = _half(row + 80, both) * (sm & 15).to(tl.float32)
                ml = _half(row + 82, both) * (sm >> 4).to(tl.float32)
                v = dl * code.to(tl.float32) - ml
            else:  # Q3_K: hmask (a clear bit subtracts 4), codes, 6-bit scales less 32, d
                lb = _byte(row + 96 + (k % 8), both)
                low = tl.where(k < 8, lb & 15, lb >> 4)
                high = (_byte(row + 104 + (k % 4), both) >> (2 * (k // 4))) & 3
                dl = _half(row + 108, both) * ((low | (high << 4)) - 32).to(tl.float32)
                hm = ((_byte(row + (j % 32), both) >> (j // 32)) & 1) ^ 1
                v = dl * (code - (hm << 2)).to(tl.float32)
        tl.store(out + b[:, None] * 256 + j, v.to(out.dtype.element_ty, fp_downcast_rounding="rtne"), mask=both)

    @triton.jit
    def _e4m3_rows(w, scale, out, rows, cols, ROWS: tl.constexpr, COLS: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        c = tl.program_id(1).to(tl.int64) * COLS + tl.arange(0, COLS)
        live = (r[:, None] < rows) & (c[None, :] < cols)
        at = r[:, None] * cols + c[None, :]
        x = tl.load(w + at, mask=live, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        s = tl.load(scale + r, mask=r < rows, other=0.0)
        tl.store(out + at, (x * s[:, None]).to(out.dtype.element_ty, fp_downcast_rounding="rtne"), mask=live)


    @triton.jit
    def _row_scale(p, live):
        """The little-endian float32 at byte pointers ``p``."""
        b0 = tl.load(p, mask=live, other=0).to(tl.uint32)
        b1 = tl.load(p + 1, mask=live, other=0).to(tl.uint32)
        b2 = tl.load(p + 2, mask=live, other=0).to(tl.uint32)
        b3 = tl.load(p + 3, mask=live, other=0).to(tl.uint32)
        return (b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)).to(tl.float32, bitcast=True)

    @triton.jit
    def _nvfp4_rows(src, tensor_scale, column_scale, out, rows, cols, stored, row_bytes, HAS_COLUMNS: tl.constexpr,
                    ROUND: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        c = tl.program_id(1).to(tl.int64) * COLS + tl.arange(0, COLS)
        live = (r[:, None] < rows) & (c[None, :] < cols)
        row = src + r[:, None] * row_bytes
        byte = tl.load(row + c[None, :] // 2, mask=live, other=0).to(tl.int32)
        code = tl.where(c[None, :] % 2 == 0, byte >> 4, byte & 15)  # the even element in the high nibble
        e, m = (code >> 1) & 3, (code & 1).to(tl.float32)
        v = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0)))
        v = tl.where((code & 8) != 0, -v, v)
        blocks = tl.load(row + stored // 2 + c[None, :] // 16, mask=live, other=0)
        blocks = blocks.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        dt = out.dtype.element_ty
        s2 = tl.load(tensor_scale)
        if ROUND:  # bf16 / fp16: each product rounded to the output dtype, as torch computes it there
            total = (s2.to(dt, fp_downcast_rounding="rtne").to(tl.float32) * blocks.to(dt).to(tl.float32))
            total = total.to(dt, fp_downcast_rounding="rtne").to(tl.float32)
            w = (v * total).to(dt, fp_downcast_rounding="rtne")
        else:
            w = v * (s2 * blocks)
        if HAS_COLUMNS:  # pre_quant_scale folded into the columns in float32
            p = tl.load(column_scale + c, mask=c < cols, other=0.0)
            w = (w.to(tl.float32) * p[None, :])
            if ROUND:
                w = w.to(dt, fp_downcast_rounding="rtne")
        tl.store(out + r[:, None] * cols + c[None, :], w.to(dt), mask=live)

    @triton.jit
    def _mxfp8_rows(src, out, rows, cols, stored, row_bytes, ROUND: tl.constexpr, ROWS: tl.constexpr,
                    COLS: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        c = tl.program_id(1).to(tl.int64) * COLS + tl.arange(0, COLS)
        live = (r[:, None] < rows) & (c[None, :] < cols)
        row = src + r[:, None] * row_bytes
        x = tl.load(row + c[None, :], mask=live, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        e = tl.load(row + stored + c[None, :] // 32, mask=live, other=0).to(tl.int32)
        s = tl.where(e == 0, 0.0, (e << 23).to(tl.float32, bitcast=True))  # 2^(e - 127); 0 for e = 0
        w = x * s
        if ROUND:
            w = w.to(out.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out + r[:, None] * cols + c[None, :], w, mask=live)

    @triton.jit
    def _int8_rows(src, out, rows, cols, row_bytes, ROUND: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        c = tl.program_id(1).to(tl.int64) * COLS + tl.arange(0, COLS)
        live = (r[:, None] < rows) & (c[None, :] < cols)
        row = src + r[:, None] * row_bytes
        q = tl.load(row + c[None, :], mask=live, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        s = _row_scale(src + r * row_bytes + cols, r < rows)
        w = q * s[:, None]
        if ROUND:
            w = w.to(out.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out + r[:, None] * cols + c[None, :], w, mask=live)

    @triton.jit
    def _int8_convrot_rows(src, hadamard, out, rows, cols, row_bytes, inv_root, G: tl.constexpr,
                           ROUND: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, K: tl.constexpr):
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        n = tl.program_id(1).to(tl.int64) * COLS + tl.arange(0, COLS)
        start = (tl.program_id(1).to(tl.int64) * COLS // G) * G  # the group's first column (COLS divides G)
        live = r[:, None] < rows
        acc = tl.zeros((ROWS, COLS), dtype=tl.float32)
        for k0 in range(0, G, K):
            k = k0 + tl.arange(0, K)
            q = tl.load(src + r[:, None] * row_bytes + start + k[None, :], mask=live, other=0)
            h = tl.load(hadamard + k[:, None] * G + (n - start)[None, :])
            acc += tl.dot(q.to(tl.int8, bitcast=True).to(tl.float16), h)
        s = _row_scale(src + r * row_bytes + cols, r < rows) * inv_root
        w = acc * s[:, None]
        if ROUND:
            w = w.to(out.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(out + r[:, None] * cols + n[None, :], w, mask=live & (n[None, :] < cols))


def _kernels():
    """The kernels (call only when :data:`HAVE_TRITON`)."""
    return _legacy_blocks, _k_blocks, _e4m3_rows


def _check_out(out: torch.Tensor, numel: int, device: torch.device) -> None:
    if out.dtype not in _OUT_DTYPES or not out.is_contiguous() or out.numel() != numel or out.device != device:
        raise ValueError(f"the output must be a contiguous bf16, fp16 or fp32 tensor of {numel} elements on {device}; "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")


def dequantize_ggml(data: torch.Tensor, qtype: str, out: torch.Tensor) -> torch.Tensor:
    """Write the values of the GGML bytes ``data`` (``uint8``, contiguous, whole blocks) into
    ``out`` (contiguous, bf16 / fp16 / fp32, as many values as the blocks hold) with one launch
    on ``data``'s CUDA device; returns ``out``. The values are
    :func:`ltx_mgpu.quantized.ggml.dequantize`'s, cast to ``out``'s dtype (module doc).

    Raises:
        ValueError: ``qtype`` not in :data:`GGML_KERNEL_TYPES`, ``data`` not CUDA ``uint8``
            contiguous whole blocks, or ``out`` of the wrong size, dtype, layout or device.
    """
    if qtype not in GGML_KERNEL_TYPES:
        raise ValueError(f"no dequantization kernel for {qtype}; kernels: {', '.join(GGML_KERNEL_TYPES)}")
    block, size = BLOCK_SHAPES[qtype]
    if data.dtype != torch.uint8 or not data.is_contiguous() or data.device.type != "cuda" or data.numel() % size:
        raise ValueError(f"{qtype} bytes must be contiguous CUDA uint8 in whole {size}-byte blocks; got {data.dtype} "
                         f"{tuple(data.shape)} on {data.device}")
    n_blocks = data.numel() // size
    _check_out(out, n_blocks * block, data.device)
    if n_blocks == 0:
        return out
    legacy, k_quant, _ = _kernels()
    kernel, kind, nb = ((legacy, _LEGACY[qtype], _LEGACY_BLOCKS) if qtype in _LEGACY else
                        (k_quant, _K_QUANTS[qtype], _K_BLOCKS))
    with torch.cuda.device(data.device):
        kernel[(-(-n_blocks // nb),)](data, out, n_blocks, KIND=kind, SIZE=size, NB=nb, num_warps=_WARPS,
                                      enable_fp_fusion=False)
    return out


def upcast_e4m3(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(weight.float() * scale[:, None]).to(dtype)`` in one launch: ``weight`` float8 e4m3
    ``[rows, cols]`` contiguous on CUDA, ``scale`` float32 ``[rows]`` on the same device.

    Raises:
        ValueError: other dtypes, shapes or devices.
    """
    if (weight.dtype != torch.float8_e4m3fn or weight.ndim != 2 or not weight.is_contiguous()
            or weight.device.type != "cuda" or scale.dtype != torch.float32 or scale.shape != weight.shape[:1]
            or scale.device != weight.device or dtype not in _OUT_DTYPES):
        raise ValueError(f"upcast_e4m3 takes a contiguous CUDA e4m3 [rows, cols] weight and a float32 [rows] scale on "
                         f"its device, into bf16 / fp16 / fp32; got {weight.dtype} {tuple(weight.shape)}, "
                         f"{scale.dtype} {tuple(scale.shape)}, {dtype}")
    rows, cols = weight.shape
    out = torch.empty(rows, cols, dtype=dtype, device=weight.device)
    if weight.numel():
        _, _, e4m3_rows = _kernels()
        grid = (-(-rows // _UPCAST_ROWS), -(-cols // _UPCAST_COLS))
        with torch.cuda.device(weight.device):
            e4m3_rows[grid](weight.view(torch.uint8), scale.contiguous(), out, rows, cols, ROWS=_UPCAST_ROWS,
                            COLS=_UPCAST_COLS, num_warps=_WARPS, enable_fp_fusion=False)
    return out


_HADAMARD: dict[tuple[int, str], torch.Tensor] = {}


def _hadamard(group: int, device: torch.device) -> torch.Tensor:
    """The regular Hadamard matrix of size ``group`` (Kronecker powers of ComfyUI ConvRot's 4 x 4
    ``[[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]]``, comfy-kitchen's
    ``_build_hadamard`` before its division by ``sqrt(group)``), fp16 ``[group, group]`` on ``device``."""
    key = (group, str(device))
    if key not in _HADAMARD:
        h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float32)
        h = h4
        while h.shape[0] < group:
            h = torch.kron(h, h4)
        _HADAMARD[key] = h.to(device=device, dtype=torch.float16).contiguous()
    return _HADAMARD[key]


def _check_rows(packed: torch.Tensor, row_bytes: int, what: str) -> None:
    if (packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] != row_bytes or not packed.is_contiguous()
            or packed.device.type != "cuda"):
        raise ValueError(f"{what} rows must be contiguous CUDA uint8 [rows, {row_bytes}]; got {packed.dtype} "
                         f"{tuple(packed.shape)} on {packed.device}")


def dequantize_nvfp4_rows(packed: torch.Tensor, cols: int, stored: int, tensor_scale: torch.Tensor,
                          column_scale: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """nvfp4 packed rows (``ltx_mgpu.quantized.rows``: ``uint8`` ``[n, stored / 2 + stored / 16]``)
    into ``out`` (``[n, cols]``, bf16 / fp16 / fp32) in one launch: comfy-kitchen's eager
    ``dequantize_nvfp4`` in ``out``'s dtype (module doc), ``column_scale`` (float32 ``[cols]``)
    folded in as ``(w.float() * p).to(dtype)``. Returns ``out``.

    Raises:
        ValueError: rows, scales or ``out`` of another dtype, shape, layout or device.
    """
    _check_rows(packed, stored // 2 + stored // 16, "nvfp4")
    n = packed.shape[0]
    _check_out(out, n * cols, packed.device)
    if (tensor_scale.dtype != torch.float32 or tensor_scale.numel() != 1 or tensor_scale.device != packed.device
            or (column_scale is not None and (column_scale.dtype != torch.float32 or column_scale.numel() != cols
                                              or column_scale.device != packed.device))):
        raise ValueError("nvfp4 rows take a float32 tensor scale and an optional float32 [cols] column scale on their "
                         "device")
    if out.numel():
        grid = (-(-n // _UPCAST_ROWS), -(-cols // _UPCAST_COLS))
        with torch.cuda.device(packed.device):
            _nvfp4_rows[grid](packed, tensor_scale, column_scale if column_scale is not None else tensor_scale, out,
                              n, cols, stored, packed.shape[1], HAS_COLUMNS=column_scale is not None,
                              ROUND=out.dtype != torch.float32, ROWS=_UPCAST_ROWS, COLS=_UPCAST_COLS,
                              num_warps=_WARPS, enable_fp_fusion=False)
    return out


def dequantize_mxfp8_rows(packed: torch.Tensor, cols: int, stored: int, out: torch.Tensor) -> torch.Tensor:
    """mxfp8 packed rows (``uint8`` ``[n, stored + stored / 32]``: the row's e4m3 values, then its
    E8M0 exponents) into ``out`` (``[n, cols]``, bf16 / fp16 / fp32) in one launch: comfy-kitchen's
    eager ``dequantize_mxfp8``, ``q * 2^(e - 127)`` in float32 (0 for ``e = 0``), then cast.
    Returns ``out``.

    Raises:
        ValueError: rows or ``out`` of another dtype, shape, layout or device.
    """
    _check_rows(packed, stored + stored // 32, "mxfp8")
    n = packed.shape[0]
    _check_out(out, n * cols, packed.device)
    if out.numel():
        grid = (-(-n // _UPCAST_ROWS), -(-cols // _UPCAST_COLS))
        with torch.cuda.device(packed.device):
            _mxfp8_rows[grid](packed, out, n, cols, stored, packed.shape[1], ROUND=out.dtype != torch.float32,
                              ROWS=_UPCAST_ROWS, COLS=_UPCAST_COLS, num_warps=_WARPS, enable_fp_fusion=False)
    return out


def dequantize_int8_rows(packed: torch.Tensor, cols: int, group: int | None, out: torch.Tensor) -> torch.Tensor:
    """int8 packed rows (``uint8`` ``[n, cols + 4]``: the row's values, then its float32 scale)
    into ``out`` (``[n, cols]``, bf16 / fp16 / fp32) in one launch: ``q * s``, or with ConvRot of
    ``group`` (a power of 4 of at least 16 dividing ``cols``) its exact rotation back, ``(q @ H) *
    s / sqrt(group)`` (module doc). Returns ``out``.

    Raises:
        ValueError: rows or ``out`` of another dtype, shape, layout or device; a group the kernel
            does not take.
    """
    _check_rows(packed, cols + 4, "int8")
    n = packed.shape[0]
    _check_out(out, n * cols, packed.device)
    if group is not None and (group < 16 or cols % group or group & (group - 1)):
        raise ValueError(f"the ConvRot kernel takes power-of-4 groups of at least 16 dividing the {cols} columns, got "
                         f"{group}")
    if not out.numel():
        return out
    rnd = out.dtype != torch.float32
    with torch.cuda.device(packed.device):
        if group is None:
            grid = (-(-n // _UPCAST_ROWS), -(-cols // _UPCAST_COLS))
            _int8_rows[grid](packed, out, n, cols, packed.shape[1], ROUND=rnd, ROWS=_UPCAST_ROWS, COLS=_UPCAST_COLS,
                             num_warps=_WARPS, enable_fp_fusion=False)
        else:
            tile, k = min(group, _ROT_COLS), min(group, _ROT_K)
            grid = (-(-n // _ROT_ROWS), cols // tile)
            _int8_convrot_rows[grid](packed, _hadamard(group, packed.device), out, n, cols, packed.shape[1],
                                     1.0 / math.sqrt(group), G=group, ROUND=rnd, ROWS=_ROT_ROWS, COLS=tile, K=k,
                                     num_warps=_WARPS, enable_fp_fusion=False)
    return out
