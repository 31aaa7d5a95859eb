"""Faster NF4 prefill for the Gemma 3 text tower: each decoder layer's weights dequantized at once
into a reused bf16 buffer, then cuBLAS GEMMs on it (:class:`FastDequant`).

On H100/H200, bitsandbytes runs every NF4 ``Linear4bit`` of a prefill (M = B x 1024 tokens) as
"dequantize the whole weight to bf16, then cuBLAS GEMM" (``_gemm_4bit_use_custom_cuda`` never
picks its fused kernel for M > 512; bitsandbytes 0.50.2's ``backends/cuda/ops.py``), per
Linear, with the double-quant scales dequantized by separate kernels each time: 336 x ~4
launches plus the Python of ``Linear4bit.forward`` / ``matmul_4bit`` per forward of Gemma 3 12B.

* **Per layer into a reused buffer** (``scope="layer"``): a forward pre-hook on each decoder
  layer dequantizes its 7 projection weights into views of one flat bf16 buffer
  (``max_layer_params x 2`` bytes, 449 MB for 12B) that every layer reuses; the projections then
  run as plain ``F.linear`` (cuBLAS) on those views. ``scope="linear"`` dequantizes each weight
  just before its GEMM into one buffer sized for the largest weight (the memory of bitsandbytes'
  own path). ``prefetch=True`` adds a second buffer and dequantizes the next layer (or
  projection) on a side CUDA stream while the current one computes (a compute-bound prefill
  GEMM leaves HBM bandwidth idle).
* **The kernel** (``method``): ``"triton"``, one Triton launch per unit for the scale dequant and
  the 4-bit dequant of all its weights (:mod:`ltx_mgpu.text.nf4.kernel`, bit-exact with
  bitsandbytes; it removes the host cost that bounds an eager 1x1024 NF4 forward), or ``"bnb"``,
  bitsandbytes' own kernel per weight. Other dequantizers can be plugged in as ``fill``
  (``benchmarks/nf4_lut.py``'s byte-LUT arms are measured that way).

The wrappers keep each projection's ``Params4bit`` as their ``weight`` parameter (same names,
same bytes; ``save_nf4`` keeps working) and :meth:`FastDequant.remove` restores the
``Linear4bit`` modules. ``benchmarks/bench_nf4.py`` times every combination.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Literal

import torch
import torch.nn.functional as F

from ltx_mgpu.text.nf4.kernel import UnitDequant

__all__ = ["METHODS", "UnitFill", "dequantize_nf4", "FastDequant", "installed_fast_dequant"]

Method = Literal["bnb", "triton"]
METHODS = ("bnb", "triton")
#: ``fill(weights, views, buffer)``: dequantize a unit's ``Params4bit`` weights into their ``[N, K]``
#: bf16 ``views`` of the flat ``buffer``.
UnitFill = Callable[[list, list, torch.Tensor], None]


def dequantize_nf4(weight: Any, out: torch.Tensor | None = None, method: Method = "bnb") -> torch.Tensor:
    """Dequantize a double-quantized NF4 ``Params4bit`` to its ``[N, K]`` bf16 weight.

    Args:
        weight: a ``bitsandbytes.nn.Params4bit`` (uint8 ``[N*K/2, 1]`` with its ``quant_state``;
            not in the AVX512-BF16 packed CPU layout).
        out: optional ``[N, K]`` (or ``N*K`` flat) tensor of the state's dtype to write into.
        method: ``"bnb"`` (``bitsandbytes.functional.dequantize_4bit``) or ``"triton"`` (one
            Triton kernel, CUDA only: :mod:`ltx_mgpu.text.nf4.kernel`).

    Returns:
        ``out`` (viewed ``[N, K]``) or a new tensor; equal to bitsandbytes' dequantization.

    Raises:
        ValueError: an unknown method; for ``"triton"``, no double quantization or ``N*K`` not a
            multiple of the blocksize.
    """
    import bitsandbytes.functional as bf

    qs = weight.quant_state
    shape = tuple(qs.shape)
    if out is None:
        out = torch.empty(shape, dtype=qs.dtype, device=weight.device)
    out = out.view(shape)
    if method == "bnb":
        if out.device.type == "cuda":
            bf.dequantize_4bit(weight.data, qs, out=out)
        else:  # bitsandbytes registers the out= variant for CUDA only
            out.copy_(bf.dequantize_4bit(weight.data, qs))
        return out
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    UnitDequant([weight], [out.view(-1)])()
    return out


class _DenseLinear(torch.nn.Module):
    """Stands in for a ``Linear4bit``: ``F.linear`` on the weight dequantized by its
    :class:`FastDequant` (``weight`` is the same ``Params4bit``; ``bias`` the same tensor)."""

    def __init__(self, original: Any, owner: "FastDequant") -> None:
        super().__init__()
        self.in_features, self.out_features = original.in_features, original.out_features
        self.weight = original.weight
        self.bias = original.bias
        self.dense: torch.Tensor | None = None
        self.unit = -1  # set by the owner: the index of the unit (layer or Linear) it belongs to
        self._refs = (original, owner)  # a tuple: neither is registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owner = self._refs[1]
        if owner.bypass:
            return self._refs[0](x)
        if owner.scope == "linear":
            owner._begin(self.unit)
        dense = self.dense
        y = F.linear(x if x.dtype == dense.dtype else x.to(dense.dtype), dense, self.bias)
        y = y if y.dtype == x.dtype else y.to(x.dtype)
        if owner.scope == "linear":
            owner._end(self.unit)
        return y


class FastDequant:
    """Replace the ``Linear4bit`` projections of a Gemma 3 text tower by buffered dequant + GEMM.

    The projections are grouped into *units* in execution order: one per decoder layer
    (``scope="layer"``: q, k, v, o, gate, up, down) or one per projection (``scope="linear"``).
    Before a unit runs, its weights are dequantized into a flat bf16 buffer sized for the
    largest unit and reused by every unit; the projections then run ``F.linear`` on views of it.

    Args:
        model: a ``Gemma3TextModel`` loaded by ``ltx_mgpu.text.nf4.quantize``.
        method: one of :data:`METHODS` (:func:`dequantize_nf4`; with ``"triton"`` a whole unit is
            dequantized by one kernel launch).
        scope: ``"layer"`` or ``"linear"``.
        fill: a :data:`UnitFill` to use instead of ``method``'s kernel (measurement arms).
        prefetch: on CUDA, dequantize unit u+1 on a side stream into a second buffer while unit u
            computes (events order the buffer reuse); ignored on CPU.

    Extra device memory: one unit's weights in bf16, two with ``prefetch`` (Gemma 3 12B: a
    layer is 224 M weights = 449 MB, the largest projection 59 M = 118 MB). Outputs equal the
    ``Linear4bit`` path's up to the GEMM (``F.linear`` on the bf16 weights bitsandbytes
    dequantizes to).
    """

    def __init__(self, model: Any, method: Method = "bnb", scope: Literal["layer", "linear"] = "layer",
                 prefetch: bool = False, fill: UnitFill | None = None) -> None:
        import bitsandbytes as bnb

        if method not in METHODS or scope not in ("layer", "linear"):
            raise ValueError(f"method must be one of {METHODS} and scope 'layer' or 'linear'; "
                             f"got {method!r}, {scope!r}")
        self.method, self.scope, self.fill = method, scope, fill
        self._slots: list[tuple[Any, str, _DenseLinear]] = []
        self.units: list[list[_DenseLinear]] = []
        self._hooks = []
        for layer in model.layers:
            wrappers = []
            for name, module in list(layer.named_modules()):
                if isinstance(module, bnb.nn.Linear4bit):
                    parent_name, _, attr = name.rpartition(".")
                    parent = layer.get_submodule(parent_name)
                    wrapper = _DenseLinear(module, self)
                    setattr(parent, attr, wrapper)
                    self._slots.append((parent, attr, wrapper))
                    wrappers.append(wrapper)
            if scope == "layer":
                u = len(self.units)
                self._hooks.append(layer.register_forward_pre_hook(lambda m, a, u=u: self._begin(u)))
                self._hooks.append(layer.register_forward_hook(lambda m, a, o, u=u: self._end(u)))
                self.units.append(wrappers)
            else:
                self.units.extend([w] for w in wrappers)
        for u, unit in enumerate(self.units):
            for w in unit:
                w.unit = u
        self._numel = max(sum(w.out_features * w.in_features for w in unit) for unit in self.units)
        self._buffers: list[torch.Tensor] = []
        cuda = self.units[0][0].weight.device.type == "cuda"
        self.prefetch = bool(prefetch and cuda)
        self._stream = torch.cuda.Stream(self.units[0][0].weight.device) if self.prefetch else None
        self._triton: dict[tuple[int, int], Any] = {}  # (unit, buffer) -> kernel.UnitDequant
        self._view_cache: dict[tuple[int, int], list[torch.Tensor]] = {}  # (unit, buffer) -> weight views
        self.bypass = False  # bypassed(): the Linear4bit modules compute, no unit is dequantized
        self._ready: dict[int, Any] = {}  # unit -> event: its weights are in its buffer
        self._free: dict[int, Any] = {}  # buffer -> event: the unit that used it has run

    def _buffer(self, k: int, device: torch.device) -> torch.Tensor:
        while len(self._buffers) <= k:
            self._buffers.append(torch.empty(self._numel, dtype=torch.bfloat16, device=device))
        return self._buffers[k]

    def _views(self, u: int, buf: torch.Tensor) -> list[torch.Tensor]:
        """Unit ``u``'s weights as views of ``buf``, made once per (unit, buffer): 14 slicing
        ops per layer were host time on every forward, which the 1x1024 encode is bound by."""
        key = (u, buf.data_ptr())
        views = self._view_cache.get(key)
        if views is None:
            views, start = [], 0
            for w in self.units[u]:
                n = w.out_features * w.in_features
                views.append(buf[start:start + n].view(w.out_features, w.in_features))
                start += n
            self._view_cache[key] = views
        return views

    def _fill(self, u: int, buf: torch.Tensor) -> None:
        unit = self.units[u]
        if self.fill is not None:
            self.fill([w.weight for w in unit], self._views(u, buf), buf)
            return
        if self.method == "triton":
            key = (u, buf.data_ptr())
            launch = self._triton.get(key)
            if launch is None:
                launch = self._triton[key] = UnitDequant([w.weight for w in unit], self._views(u, buf))
            launch()
            return
        for w, v in zip(unit, self._views(u, buf)):
            dequantize_nf4(w.weight, v, self.method)

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Within it, every projection runs its original ``Linear4bit`` (bitsandbytes' own path,
        whose one-token inference kernel reads the 4-bit weight once) and no unit is dequantized:
        a decode step of one token would otherwise dequantize every layer's weights in full."""
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        self.bypass = True
        try:
            yield
        finally:
            self.bypass = False

    def _begin(self, u: int) -> None:
        if self.bypass:
            return
        device = self.units[u][0].weight.device
        k = u % 2 if self.prefetch else 0
        buf = self._buffer(k, device)
        if self.prefetch and u == 0:
            # a forward starts: the side stream follows everything before it (which is what lets
            # a CUDA graph capture take its prefetches in: ltx_mgpu.text.gemma.graphs), and events
            # left from the last forward (perhaps recorded in a capture) are not waited on
            self._stream.wait_stream(torch.cuda.current_stream(device))
            self._free.clear()
        if self.prefetch and u in self._ready:
            torch.cuda.current_stream(device).wait_event(self._ready.pop(u))
        else:
            if self.prefetch:  # a stray prefetch may still write this buffer: order after it
                torch.cuda.current_stream(device).wait_stream(self._stream)
                self._ready.clear()
            self._fill(u, buf)
        for w, v in zip(self.units[u], self._views(u, buf)):
            w.dense = v
        if self.prefetch and u + 1 < len(self.units):
            nxt = self._buffer(1 - k, device)
            with torch.cuda.stream(self._stream):
                if (1 - k) in self._free:
                    self._stream.wait_event(self._free.pop(1 - k))
                self._fill(u + 1, nxt)
                self._ready[u + 1] = self._stream.record_event()

    def _end(self, u: int) -> None:
        if self.bypass:
            return
        for w in self.units[u]:
            w.dense = None
        if self.prefetch:
            self._free[u % 2] = torch.cuda.current_stream().record_event()

    def remove(self) -> None:
        """Put the original ``Linear4bit`` modules back and free the buffers."""
        for h in self._hooks:
            h.remove()
        for parent, attr, wrapper in self._slots:
            setattr(parent, attr, wrapper._refs[0])
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        self._hooks, self._slots, self._buffers, self._ready, self._free, self._triton = [], [], [], {}, {}, {}
        self._view_cache = {}


def installed_fast_dequant(model: torch.nn.Module) -> FastDequant | None:
    """The :class:`FastDequant` installed on ``model``'s projections, or None."""
    for module in model.modules():
        if isinstance(module, _DenseLinear):
            return module._refs[1]
    return None
