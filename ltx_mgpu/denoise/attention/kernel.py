"""8-bit flash attention in Triton: forward only, non-causal, no mask, head dims 64 and 128.

``attend(q, k, v, heads)`` computes ``softmax(q k^T / sqrt(D)) v`` per head on ltx-core's
layout (q ``[B, Tq, H*D]``, k and v ``[B, Tk, H*D]``, bf16 or fp16; any token counts) with
both matrix products on 8-bit tensor cores (Hopper's ``wgmma`` at twice the bf16 rate):

* **Q K^T** in int8 (``QK="int8"``, the default) or float8 e4m3 (``QK="e4m3"``), int32 / float32
  accumulation. Q is quantized inside the kernel with a scale per token (its row's amax), K by
  :func:`quantize_kv` with one scale per block of ``BLOCK_N`` tokens and head. The scores are
  rescaled by ``scale_q[m] * scale_k[block]`` before the softmax, so the logits are exact up to
  the rounding of Q and K. Why int8 first: Q and K are RMS-normalized in LTX-2, their values of
  one row or block are of one magnitude, and an 8-bit integer with a per-row scale rounds them
  with 7 bits of precision against e4m3's 3 mantissa bits: a float32 emulation of both at LTX-2's
  shapes (:func:`reference`) gives the int8 logits about a third of the e4m3 error at the same
  tensor-core rate.
* **P V** in e4m3 (``PV="e4m3"``, the default) or the inputs' 16-bit dtype (``PV="16bit"``).
  P is taken as ``448 * exp(s - max)`` (in [0, 448]: e4m3's whole range, so its small values
  keep precision; the 448 cancels against the softmax's sum ``l`` of the same P) and cast to
  e4m3; V is quantized by :func:`quantize_kv` with one scale per channel and head over all
  tokens (the scale factors out of the sum over tokens and is applied once, with the softmax's
  1/l, to the output). V is stored transposed
  (``[B, H, D, Tk]``): Hopper's 8-bit ``wgmma`` reads both operands K-major. The running sum
  ``l`` is of the unrounded P. Each key block's e4m3 P V is summed on the tensor cores alone and
  then added to the float32 accumulator (Hopper's fp8 MMA adds with reduced precision;
  ``Config.fast_accum`` leaves the whole sum to it). ``PV="16bit"`` reads V as given (one
  product on 8-bit tensor cores instead of two, less error).

The online softmax is the flash-attention recurrence (Dao et al., "FlashAttention", 2022,
Algorithm 1; base-2 exponentials with ``log2(e) / sqrt(D)`` folded into the scale, as in
Triton's fused-attention tutorial). The last, partial key block is masked to ``-inf`` (K and V
are zero-padded to whole blocks by :func:`quantize_kv`); query rows past ``Tq`` are not
stored. An all-zero row of Q or block of K stays finite (its scale is clamped).

Errors: ``ValueError`` for shapes and dtypes outside the contract (before any launch);
``RuntimeError`` where Triton or a CUDA device is missing (:func:`available`).
``TRITON_INTERPRET=1`` runs the kernels on the CPU (Triton's interpreter) at small shapes; its
float32 -> e4m3 cast is not the GPU's round-to-nearest (Triton 3.9's interpreter casts 31.4 to
16), so there only the int8 / 16-bit formats and exactly representable values give the GPU's
numbers.
"""

from __future__ import annotations

import importlib.util
import math
import os
from typing import NamedTuple

import torch

__all__ = ["CONFIGS", "HEAD_DIMS", "PV_FORMATS", "QK_FORMATS", "Config", "attend", "attend_heads", "available",
           "quantize_kv", "reference"]

#: The head dims the kernel takes (``tl.arange`` needs a power of two; LTX-2: video 128, audio 64).
HEAD_DIMS = (64, 128)
#: The formats of the Q K^T product and of the P V product.
QK_FORMATS = ("int8", "e4m3")
PV_FORMATS = ("e4m3", "16bit")
_E4M3_MAX = 448.0
_INT8_MAX = 127.0
#: The smallest amax a scale is taken from (a zero row or block scales to finite zeros).
_TINY = 1e-30


class Config(NamedTuple):
    """A launch configuration: query rows and keys per program step, warps, pipeline stages,
    whether the 8-bit K and V tiles are read through TMA descriptors (Hopper's tensor memory
    accelerator, ``triton.tools.tensor_descriptor``) instead of pointer loads, and whether the e4m3
    P V accumulates on the tensor cores across key blocks (``fast_accum``; Hopper's fp8 MMA adds
    with reduced precision, so over 24,576 keys its truncations add up) instead of per block,
    then in float32 (Triton's ``max_num_imprecise_acc``)."""

    block_m: int = 128
    block_n: int = 128
    warps: int = 8
    stages: int = 3
    tma: bool = False
    fast_accum: bool = False


#: The configuration per head dim (the default of :func:`attend`). ``benchmarks/bench_attention.py
#: --sweep`` times the alternatives at LTX-2's shapes.
CONFIGS = {128: Config(64, 128, 4, 3), 64: Config(64, 128, 4, 3)}

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available(device: torch.device | str | None = None) -> bool:
    """Whether the kernels can run on ``device``: Triton importable and a CUDA device (or Triton's
    CPU interpreter, ``TRITON_INTERPRET=1``, for a CPU device)."""
    if not HAVE_TRITON:
        return False
    dev = torch.device(device) if device is not None else None
    if _interpreting():
        return dev is None or dev.type == "cpu"
    return torch.cuda.is_available() and (dev is None or dev.type == "cuda")


if HAVE_TRITON:  # module-level kernels: Triton resolves the helpers they call by name
    import triton
    import triton.language as tl

    @triton.jit
    def _round_int8(x):
        """float32 -> int8, round half away from zero (the float-to-int cast truncates)."""
        return tl.where(x >= 0, x + 0.5, x - 0.5).to(tl.int8)

    @triton.jit
    def _quantize_kv(K, V, K8, KS, V8, VS, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, H, TK, TKP,
                     D: tl.constexpr, BLOCK_N: tl.constexpr, QK_INT8: tl.constexpr, PV_FP8: tl.constexpr):
        """One program per (key block, batch x head): K's block to int8 / e4m3 with its scale;
        V's block to e4m3 with the per-channel scale ``VS`` (already computed), stored transposed."""
        nb = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        rn = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        rd = tl.arange(0, D)
        live = rn[:, None] < TK
        k = tl.load(K + b * s_kb + h * s_kh + rn[:, None] * s_kt + rd[None, :], mask=live, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(k), axis=1), axis=0), 1e-30)
        if QK_INT8:
            k8 = _round_int8(k * (127.0 / amax))
            scale = amax / 127.0
        else:
            k8 = (k * (448.0 / amax)).to(tl.float8e4nv)
            scale = amax / 448.0
        tl.store(K8 + bh * TKP * D + rn[:, None] * D + rd[None, :], k8)
        tl.store(KS + bh * (TKP // BLOCK_N) + nb, scale)
        if PV_FP8:
            v = tl.load(V + b * s_vb + h * s_vh + rn[:, None] * s_vt + rd[None, :], mask=live, other=0.0)
            vs = tl.load(VS + bh * D + rd)
            v8 = (v.to(tl.float32) * (448.0 / tl.maximum(vs, 1e-30))[None, :]).to(tl.float8e4nv)
            tl.store(V8 + bh * D * TKP + rd[None, :] * TKP + rn[:, None], v8)  # [D, TKP]: K-major for P V

    @triton.jit
    def _step(acc, l_i, m_i, q8, row_scale, K8, KS, V8, V, KD, VD, kd_row, vd_row, n0, nb, TK, TKP, s_vt, v_off,
              D: tl.constexpr, BLOCK_N: tl.constexpr, QK_INT8: tl.constexpr, PV_FP8: tl.constexpr,
              TMA: tl.constexpr, FAST_ACCUM: tl.constexpr, TAIL: tl.constexpr):
        """One key block of the online softmax: scores, running max and sum, ``acc += P V``."""
        rn = n0 + tl.arange(0, BLOCK_N)
        rd = tl.arange(0, D)
        if TMA:  # noqa: SIM108 - a static branch of the kernel
            k = KD.load([kd_row + n0, 0])
        else:
            k = tl.load(K8 + rn[:, None] * D + rd[None, :])
        if QK_INT8:  # noqa: SIM108 - a static branch of the kernel
            s = tl.dot(q8, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
        else:
            s = tl.dot(q8, tl.trans(k))
        if TAIL:
            s = tl.where(rn[None, :] < TK, s, float("-inf"))
        scale = row_scale * tl.load(KS + nb)  # > 0: the max of the scaled scores is the scaled max
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale)
        # P x 448 (log2(448) folded into the subtracted max): one FMA and one exp2 per score
        p = tl.math.exp2(s * scale[:, None] - (m_new - 8.807354922057604)[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if PV_FP8:
            if TMA:  # noqa: SIM108 - a static branch of the kernel
                v = tl.trans(VD.load([vd_row, n0]))  # [D, BLOCK_N] tile, read as [BLOCK_N, D]: K-major
            else:
                v = tl.load(V8 + rd[None, :] * TKP + rn[:, None])
            if FAST_ACCUM:  # the tensor cores' own fp8 accumulation into acc, over every key block
                acc = tl.dot(p.to(tl.float8e4nv), v, acc)
            else:  # each block's product summed alone, then added to acc in float32 (two-level)
                acc = tl.dot(p.to(tl.float8e4nv), v, acc, max_num_imprecise_acc=BLOCK_N)
        else:
            v = tl.load(V + v_off + rn[:, None] * s_vt + rd[None, :], mask=rn[:, None] < TK, other=0.0)
            acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, l_i, m_new

    @triton.jit
    def _attend(Q, K8, KS, V8, VS, V, Out, KD, VD, s_qb, s_qt, s_qh, s_vb, s_vt, s_vh, s_ob, s_ot, s_oh,
                H, TQ, TK, TKP, qk_scale,
                D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, QK_INT8: tl.constexpr,
                PV_FP8: tl.constexpr, TMA: tl.constexpr, FAST_ACCUM: tl.constexpr):
        """One program per (block of query rows, batch x head)."""
        pid_m = tl.program_id(0)
        bh = tl.program_id(1).to(tl.int64)
        b = bh // H
        h = bh % H
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rd = tl.arange(0, D)
        q = tl.load(Q + b * s_qb + h * s_qh + rm[:, None] * s_qt + rd[None, :], mask=rm[:, None] < TQ,
                    other=0.0).to(tl.float32)
        q_amax = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-30)
        if QK_INT8:
            q8 = _round_int8(q * (127.0 / q_amax)[:, None])
            row_scale = q_amax * (qk_scale / 127.0)
        else:
            q8 = (q * (448.0 / q_amax)[:, None]).to(tl.float8e4nv)
            row_scale = q_amax * (qk_scale / 448.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        K8 += bh * TKP * D
        KS += bh * (TKP // BLOCK_N)
        V8 += bh * D * TKP
        v_off = b * s_vb + h * s_vh
        kd_row = (bh * TKP).to(tl.int32)  # the descriptors' rows: K8 as [B*H*TKP, D], V8 as [B*H*D, TKP]
        vd_row = (bh * D).to(tl.int32)
        full = TK // BLOCK_N
        for nb in range(0, full):
            acc, l_i, m_i = _step(acc, l_i, m_i, q8, row_scale, K8, KS, V8, V, KD, VD, kd_row, vd_row, nb * BLOCK_N,
                                  nb, TK, TKP, s_vt, v_off, D, BLOCK_N, QK_INT8, PV_FP8, TMA, FAST_ACCUM, False)
        if full * BLOCK_N < TK:
            acc, l_i, m_i = _step(acc, l_i, m_i, q8, row_scale, K8, KS, V8, V, KD, VD, kd_row, vd_row,
                                  full * BLOCK_N, full, TK, TKP, s_vt, v_off, D, BLOCK_N, QK_INT8, PV_FP8, TMA,
                                  FAST_ACCUM, True)
        if PV_FP8:  # noqa: SIM108 - a static branch of the kernel
            out = acc * (tl.load(VS + bh * D + rd) / 448.0)[None, :] / l_i[:, None]  # P's 448 is in l_i too
        else:
            out = acc / l_i[:, None]
        tl.store(Out + b * s_ob + h * s_oh + rm[:, None] * s_ot + rd[None, :], out.to(Out.dtype.element_ty),
                 mask=rm[:, None] < TQ)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qk: str, pv: str) -> int:
    """The head dim of ``[B, T, H, D]`` q, k, v, after checking the contract (raises ValueError naming the fix)."""
    if qk not in QK_FORMATS or pv not in PV_FORMATS:
        raise ValueError(f"qk must be one of {QK_FORMATS} and pv one of {PV_FORMATS}, got {qk!r}, {pv!r}")
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, H, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must be one dtype, bfloat16 or float16, got {q.dtype}, {k.dtype}, {v.dtype}: "
                         "use attention_type 'pytorch' for other dtypes")
    b, _, h, d = q.shape
    if k.shape != v.shape or (k.shape[0], k.shape[2], k.shape[3]) != (b, h, d):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not self- or "
                         "cross-attention of one batch, head count and head dim")
    if d not in HEAD_DIMS:
        raise ValueError(f"the 8-bit attention kernel takes head dims {HEAD_DIMS}, got {d}: use attention_type "
                         "'pytorch'")
    if q.shape[1] < 1 or k.shape[1] < 1:
        raise ValueError(f"q and k need at least one token, got {q.shape[1]} and {k.shape[1]}")
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1:
        raise ValueError("q, k, v must be contiguous in their last dim")
    return d


def quantize_kv(k: torch.Tensor, v: torch.Tensor, block_n: int, qk: str = "int8", pv: str = "e4m3"):
    """K and V as :func:`attend_heads`' kernel reads them.

    Args:
        k, v: ``[B, Tk, H, D]`` views (bf16 / fp16, last dim contiguous, other strides free).
    Returns:
        ``(k8, k_scale, v8, v_scale)``: ``k8`` ``[B, H, Tk_pad, D]`` int8 or e4m3 (``qk``),
        ``Tk_pad`` the next multiple of ``block_n``, padding zero; ``k_scale`` ``[B, H, Tk_pad /
        block_n]`` float32 (``k ~= k8 * k_scale`` per block); for ``pv`` e4m3, ``v8`` ``[B, H, D,
        Tk_pad]`` e4m3 (transposed) and ``v_scale`` ``[B, H, D]`` float32 (the channel's amax over
        all tokens; ``v ~= v8 * v_scale / 448``), else both None.
    """
    b, tk, heads, d = k.shape
    tkp = -(-tk // block_n) * block_n
    k8 = torch.empty(b, heads, tkp, d, device=k.device, dtype=torch.int8 if qk == "int8" else torch.float8_e4m3fn)
    ks = torch.empty(b, heads, tkp // block_n, device=k.device, dtype=torch.float32)
    v8 = vs = None
    if pv == "e4m3":
        v8 = torch.empty(b, heads, d, tkp, device=k.device, dtype=torch.float8_e4m3fn)
        vs = v.abs().amax(dim=1).float().contiguous()  # [B, H, D]
    _quantize_kv[(tkp // block_n, b * heads)](
        k, v, k8, ks, v8 if v8 is not None else k8, vs if vs is not None else ks,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), heads, tk, tkp,
        D=d, BLOCK_N=block_n, QK_INT8=qk == "int8", PV_FP8=pv == "e4m3")
    return k8, ks, v8, vs


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, *, qk: str = "int8", pv: str = "e4m3",
           config: Config | None = None) -> torch.Tensor:
    """``softmax(q k^T / sqrt(D)) v`` per head with 8-bit matrix products (see the module's docstring).

    Args:
        q: ``[B, Tq, H*D]``; k, v: ``[B, Tk, H*D]``; bf16 or fp16, one dtype, last dim contiguous
            (other strides free: the views of ltx-core and of the Ulysses exchange are read as they are).
        heads: H; ``D = q.shape[2] / H`` must be one of :data:`HEAD_DIMS`.
        qk, pv: the formats of the two products (:data:`QK_FORMATS`, :data:`PV_FORMATS`).
        config: the launch configuration (default :data:`CONFIGS` for the head dim).
    Returns:
        ``[B, Tq, H*D]`` in q's dtype.
    Raises:
        ValueError: shapes or dtypes outside the contract. RuntimeError: the kernel cannot run on
        q's device (:func:`available`).
    """
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or heads < 1 or q.shape[2] % heads:
        raise ValueError(f"q, k, v must be [B, T, H*D] with H = {heads} dividing H*D, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    d = q.shape[2] // heads
    q4, k4, v4 = (t.unflatten(2, (heads, d)) if t.shape[2] == heads * d else t for t in (q, k, v))
    return attend_heads(q4, k4, v4, qk=qk, pv=pv, config=config).flatten(2)


def attend_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, qk: str = "int8", pv: str = "e4m3",
                 config: Config | None = None) -> torch.Tensor:
    """:func:`attend` on ``[B, T, H, D]`` views (q ``[B, Tq, H, D]``, k and v ``[B, Tk, H, D]``,
    last dim contiguous, other strides free: ``x.transpose(1, 2)`` of a ``[B, H, T, D]`` tensor is
    read without a copy). Returns ``[B, Tq, H, D]`` (contiguous) in q's dtype; raises as
    :func:`attend`."""
    d = _check(q, k, v, qk, pv)
    if not available(q.device):
        raise RuntimeError(f"the 8-bit attention kernel needs Triton and a CUDA GPU; q is on {q.device}"
                           f"{'' if HAVE_TRITON else ' and Triton is not installed'}")
    cfg = config if config is not None else CONFIGS[d]
    b, tq, heads, _ = q.shape
    tk = k.shape[1]
    k8, ks, v8, vs = quantize_kv(k, v, cfg.block_n, qk, pv)
    out = torch.empty(b, tq, heads, d, device=q.device, dtype=q.dtype)
    fp8_pv = pv == "e4m3"
    kd = vd = k8
    if cfg.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor  # triton: optional, GPU machines only

        kd = TensorDescriptor.from_tensor(k8.view(-1, d), [cfg.block_n, d])
        vd = TensorDescriptor.from_tensor(v8.view(-1, k8.shape[2]), [d, cfg.block_n]) if fp8_pv else kd
    _attend[(triton.cdiv(tq, cfg.block_m), b * heads)](
        q, k8, ks, v8 if fp8_pv else k8, vs if fp8_pv else ks, v, out, kd, vd,
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2), heads, tq, tk, k8.shape[2], math.log2(math.e) / math.sqrt(d),
        D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, QK_INT8=qk == "int8", PV_FP8=fp8_pv, TMA=cfg.tma,
        FAST_ACCUM=cfg.fast_accum,
        num_warps=cfg.warps, num_stages=cfg.stages)
    return out


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, *, qk: str = "int8", pv: str = "e4m3",
              block_n: int = 128) -> torch.Tensor:
    """The kernel's rounding emulated in float32 torch (any device, no Triton): Q per token, K per
    block of ``block_n`` tokens, P x 448 and V per channel, as the kernel rounds them, then exact
    float32 attention. The kernel's result differs from it by the order of its sums and by P,
    which the kernel rounds against the running max of the online softmax rather than the row's
    final one (the same relative rounding, other instances). Used to choose the formats (the
    module's docstring) and by the tests."""
    b, tq, hd = q.shape
    tk, d = k.shape[1], hd // heads
    qf, kf, vf = (t.float().view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]

    def rounded(x: torch.Tensor, amax: torch.Tensor, fmt: str) -> torch.Tensor:
        amax = amax.clamp(min=_TINY)
        if fmt == "int8":
            y = x * (_INT8_MAX / amax)
            return torch.where(y >= 0, y + 0.5, y - 0.5).trunc() * (amax / _INT8_MAX)
        return (x * (_E4M3_MAX / amax)).to(torch.float8_e4m3fn).float() * (amax / _E4M3_MAX)

    qr = rounded(qf, qf.abs().amax(-1, keepdim=True), qk)
    pad = -tk % block_n
    kp = torch.nn.functional.pad(kf, (0, 0, 0, pad)).view(b, heads, -1, block_n, d)
    kr = rounded(kp, kp.abs().amax((-1, -2), keepdim=True), qk).view(b, heads, -1, d)[:, :, :tk]
    s = qr @ kr.transpose(-1, -2) / math.sqrt(d)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    lsum = p.sum(-1, keepdim=True)
    if pv == "e4m3":
        vs = vf.abs().amax(-2, keepdim=True).clamp(min=_TINY)
        vr = (vf * (_E4M3_MAX / vs)).to(torch.float8_e4m3fn).float() * (vs / _E4M3_MAX)
        out = ((p * _E4M3_MAX).to(torch.float8_e4m3fn).float() / _E4M3_MAX) @ vr / lsum
    else:
        out = p.to(q.dtype).float() @ vf / lsum
    return out.transpose(1, 2).reshape(b, tq, hd).to(q.dtype)
