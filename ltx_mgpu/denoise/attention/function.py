"""The 8-bit Triton attention (:mod:`ltx_mgpu.denoise.attention.kernel`) as an ltx-core attention
function: ``attention_type`` :data:`TRITON_8BIT`.

ltx-core 1.0.0 builds every ``Attention`` module with one ``attention_function`` from the
config's ``attention_type`` (``AttentionFunction``'s values only), so the model is built with
``"pytorch"`` (:func:`core_attention_type`) and :func:`install` then points every module's
``attention_function`` at :class:`TritonAttention` (module attributes, never a fork of
ltx-core's code). The Ulysses wrappers (:mod:`ltx_mgpu.denoise.parallel.ulysses`) wrap whatever
function a module holds, so sequence parallelism runs around it unchanged.

The kernel runs as the custom operator ``torch.ops.ltx_mgpu.attention_8bit`` (``torch.library``),
so ``torch.compile`` (dtype fp8 compiles the blocks) treats it as one opaque call of known
output shape instead of tracing Triton's launcher.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
from ltx_core.model.transformer.attention import (
    Attention,
    AttentionFunction,
    FlashAttention3,
    PytorchAttention,
    XFormersAttention,
)

from ltx_mgpu.denoise.attention import kernel

__all__ = ["MIN_CAPABILITY", "TRITON_8BIT", "TritonAttention", "attention_function", "core_attention_type", "install",
           "support_error", "traceable"]

#: The ``attention_type`` of this backend (one of :data:`ltx_mgpu.choices.ATTENTION_TYPES`).
TRITON_8BIT = "triton_8bit"
#: The oldest GPU the kernel is built for: Hopper (compute capability 9.0; 8-bit ``wgmma``).
MIN_CAPABILITY = (9, 0)


def support_error(device: torch.device | str) -> str | None:
    """None when :class:`TritonAttention` can run on ``device`` (a CUDA GPU of compute capability
    9.0 or newer with Triton installed), else the message naming the fix."""
    device = torch.device(device)
    fix = "load the model with attention_type 'pytorch' (or 'default')"
    if device.type != "cuda":
        return (f"attention_type '{TRITON_8BIT}' cannot run on {device.type} (its Triton kernels need an NVIDIA "
                f"Hopper or newer GPU): {fix}")
    if importlib.util.find_spec("triton") is None:
        return f"attention_type '{TRITON_8BIT}' needs Triton, not installed here: pip install triton, or {fix}"
    cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap < MIN_CAPABILITY:
        return (f"attention_type '{TRITON_8BIT}' needs compute capability 9.0 or newer (Hopper, Blackwell); "
                f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}: {fix}")
    return None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@torch.library.custom_op("ltx_mgpu::attention_8bit", mutates_args=())
def _attention_8bit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, qk: str, pv: str) -> torch.Tensor:
    """``kernel.attend`` with its default configuration (a non-contiguous last dim copied)."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return kernel.attend(q, k, v, heads, qk=qk, pv=pv)


@_attention_8bit.register_fake
def _attention_8bit_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, qk: str,
                          pv: str) -> torch.Tensor:
    return q.new_empty(q.shape)


class TritonAttention:
    """ltx-core's ``AttentionCallable`` on the 8-bit Triton kernel.

    ``__call__(q, k, v, heads, mask=None)``: q ``[B, Tq, H*D]``, k and v ``[B, Tk, H*D]`` (bf16 or
    fp16, D 64 or 128) -> ``[B, Tq, H*D]`` in q's dtype, ``softmax(q k^T / sqrt(D)) v`` per head
    with int8 Q K^T and e4m3 P V (:mod:`ltx_mgpu.denoise.attention.kernel`: the formats, their
    error). With a ``mask`` (an additive bias, as ltx-core passes it: the text cross-attention's
    padding, a guide's attention mask; the Ulysses and token-bucket padding cut the padded keys
    instead and pass no mask) the call falls back to
    ltx-core's ``PytorchAttention`` (SDPA, the inputs' dtype), exactly what ``'pytorch'`` computes.

    ``qk`` / ``pv``: the formats of the two products (``kernel.QK_FORMATS`` / ``kernel.PV_FORMATS``;
    the defaults are what ``attention_type triton_8bit`` runs, the others are for the benchmarks).

    Raises:
        ValueError: a dtype or head dim the kernel does not take (the message names the fix); at
            construction, an unknown format.
        RuntimeError: no Triton or no CUDA device for the call (:func:`support_error` refuses
            these at load).
    """

    def __init__(self, qk: str = "int8", pv: str = "e4m3"):
        if qk not in kernel.QK_FORMATS or pv not in kernel.PV_FORMATS:
            raise ValueError(f"qk must be one of {kernel.QK_FORMATS} and pv one of {kernel.PV_FORMATS}, got {qk!r}, "
                             f"{pv!r}")
        self.qk, self.pv = qk, pv

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
        if mask is not None:
            return PytorchAttention()(q, k, v, heads, mask)
        return torch.ops.ltx_mgpu.attention_8bit(q, k, v, heads, self.qk, self.pv)

    def __repr__(self) -> str:
        return f"TritonAttention(qk={self.qk!r}, pv={self.pv!r})"


def core_attention_type(name: str) -> str:
    """The ``attention_type`` to build ltx-core's model with for our ``name``: ``'pytorch'`` for
    :data:`TRITON_8BIT` (then :func:`install`), else ``name`` itself."""
    return "pytorch" if name == TRITON_8BIT else name


def attention_function(name: str):
    """The attention callable ``name`` (one of :data:`ltx_mgpu.choices.ATTENTION_TYPES`) stands for:
    a :class:`TritonAttention` or ltx-core's ``AttentionFunction(name)``.

    Raises:
        ValueError: a name ltx-core does not know either.
    """
    return TritonAttention() if name == TRITON_8BIT else AttentionFunction(name)


def traceable(fn):
    """The attention callable ``fn`` in a form ``torch.compile`` traces without a graph break:
    an ltx-core ``AttentionFunction`` member (an ``Enum`` whose call Dynamo cannot trace in some
    torch versions, 2.9 for one: a graph break and a restarted trace at every attention) becomes
    ``functools.partial(AttentionFunction.__call__, member)``, the same call; anything else is
    returned as is.

    The member's call makes an instance of one of ltx-core's attention classes, subclasses of a
    ``typing.Protocol``, whose first instantiation in a process replaces the class's ``__init__``
    (``typing``'s ``_no_init_or_replace_init``): the class dict Dynamo guarded on while tracing
    the first block changes, and the next block is traced and compiled again. So each of those
    classes is instantiated once here, before any trace."""
    if isinstance(fn, AttentionFunction):
        for cls in (PytorchAttention, XFormersAttention, FlashAttention3):
            cls()
        return functools.partial(AttentionFunction.__call__, fn)
    return fn


def install(model: torch.nn.Module, fn) -> int:
    """Point every ltx-core ``Attention`` module of ``model`` at ``fn``; returns how many.

    Call before wrapping the model for sequence parallelism (the wrappers keep the function
    they find as their inner one)."""
    count = 0
    for module in model.modules():
        if isinstance(module, Attention):
            module.attention_function = fn
            count += 1
    return count
