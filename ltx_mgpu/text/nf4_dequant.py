"""Faster NF4 prefill for the Gemma 3 text tower: the two known ideas, selectable, to be measured.

On H100/H200, bitsandbytes runs every NF4 ``Linear4bit`` of a prefill (M = B x 1024 tokens) as
"dequantize the whole weight to bf16, then cuBLAS GEMM" (``_gemm_4bit_use_custom_cuda`` never
picks its fused kernel for M > 512; bitsandbytes 0.50.2's ``backends/cuda/ops.py``), per
Linear, with the double-quant scales dequantized by separate kernels each time: 336 x ~4
launches plus the Python of ``Linear4bit.forward`` / ``matmul_4bit`` per forward of Gemma 3 12B.

* **(a) dequantize per layer into a reused buffer** (``scope="layer"``): a forward pre-hook on
  each decoder layer dequantizes its 7 projection weights into views of one flat bf16 buffer
  (``max_layer_params x 2`` bytes, 449 MB for 12B) that every layer reuses; the projections then
  run as plain ``F.linear`` (cuBLAS) on those views. ``scope="linear"`` dequantizes each weight
  just before its GEMM into one buffer sized for the largest weight (the memory of bitsandbytes'
  own path). ``prefetch=True`` adds a second buffer and dequantizes the next layer (or
  projection) on a side CUDA stream while the current one computes (a compute-bound prefill
  GEMM leaves HBM bandwidth idle).
* **(b) the byte-LUT dequant** (``method="lut"``): a ``[256, 2]`` float32 table whose row ``b``
  holds ``(code[b >> 4], code[b & 15])`` (element 2i is the high nibble), so one
  gather per packed byte yields both values, times the block's scale. Bit-exact with
  bitsandbytes (float32 table and multiply, then one rounding to bf16). ``"lut_compiled"`` runs
  the same function through ``torch.compile`` (Inductor fuses the scale dequant, the gather, the
  multiply and the bf16 store: read 0.5 + 1/64 B, write 2 B per weight; inside
  :class:`FastDequant` a whole unit is one compiled call, one graph for all decoder layers);
  ``"bnb"`` uses bitsandbytes' own kernel. Eager ``"lut"`` materialises int32 indices and
  float32 values (~10 B of traffic per weight): a reference, not a contender.
* **(c) one Triton launch per unit** (``method="triton"``, ``ltx_mgpu.text.nf4_triton``): the
  scale dequant and the 4-bit dequant of all of a unit's weights in one kernel, bit-exact with
  bitsandbytes. It removes the host cost that bounds an eager 1x1024 NF4 forward (3 launches
  and bitsandbytes' Python per weight); the loader's default on a GPU.

Measured and not kept (H200, session 4): cuBLAS leaving SMs free to the side-stream dequant
(torch's experimental ``_set_sm_carveout_experimental``, 8/16/32 SMs) gave nothing with the
full-grid kernel, and with the dequant confined to those SMs (a few looping programs) the 1x1024
encode took 2-7x our bf16: the layer's dequant must finish within the layer, which needs the
whole GPU's bandwidth.

The wrappers keep each projection's ``Params4bit`` as their ``weight`` parameter (same names,
same bytes; ``save_nf4`` keeps working) and :meth:`FastDequant.remove` restores the
``Linear4bit`` modules. ``benchmarks/bench_nf4.py`` times every combination.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = ["METHODS", "nf4_byte_lut", "dequantize_nf4", "FastDequant"]

Method = Literal["bnb", "lut", "lut_compiled", "triton"]
METHODS = ("bnb", "lut", "lut_compiled", "triton")


def nf4_byte_lut(code: torch.Tensor) -> torch.Tensor:
    """``[256, 2]`` table, row ``b`` = ``(code[b >> 4], code[b & 15])``, dtype/device of ``code``.

    Args:
        code: the 16 NF4 code values (``quant_state.code``, bitsandbytes index order).
    """
    b = torch.arange(256, device=code.device)
    return torch.stack((code[b >> 4], code[b & 15]), dim=1).contiguous()


def _absmax_impl(absmax_u8: torch.Tensor, code8: torch.Tensor, nested: torch.Tensor, offset: torch.Tensor,
                 nested_blocksize: int) -> torch.Tensor:
    idx = torch.arange(absmax_u8.numel(), device=absmax_u8.device) // nested_blocksize
    return code8[absmax_u8.long()] * nested[idx] + offset


def _lut_impl(packed: torch.Tensor, absmax_u8: torch.Tensor, code8: torch.Tensor, nested: torch.Tensor,
              offset: torch.Tensor, lut: torch.Tensor, out: torch.Tensor, nested_blocksize: int) -> None:
    scale = _absmax_impl(absmax_u8, code8, nested, offset, nested_blocksize)
    vals = lut.index_select(0, packed.reshape(-1).int())  # [n/2, 2]: one gather per byte
    out.copy_((vals.view(scale.numel(), -1) * scale[:, None]).view(out.shape))


@functools.lru_cache(maxsize=None)
def _compiled_lut():
    return torch.compile(_lut_impl, dynamic=False, fullgraph=True)


def _lut_unit_impl(weights: list, buf: torch.Tensor, spans: tuple, nested_blocksize: int) -> None:
    """Dequantize several weights into ``buf[start:start + n]`` (``spans``: static ints), one call."""
    for (packed, absmax_u8, code8, nested, offset, lut), (start, n) in zip(weights, spans):
        _lut_impl(packed, absmax_u8, code8, nested, offset, lut, buf[start:start + n], nested_blocksize)


@functools.lru_cache(maxsize=None)
def _compiled_lut_unit():
    # one graph per unit layout (every Gemma decoder layer shares one), one guard check per call
    return torch.compile(_lut_unit_impl, dynamic=False, fullgraph=True)


def dequantize_nf4(weight: Any, out: torch.Tensor | None = None, method: Method = "lut",
                   lut: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize a double-quantized NF4 ``Params4bit`` to its ``[N, K]`` bf16 weight.

    Args:
        weight: a ``bitsandbytes.nn.Params4bit`` (uint8 ``[N*K/2, 1]`` with its ``quant_state``;
            not in the AVX512-BF16 packed CPU layout).
        out: optional ``[N, K]`` (or ``N*K`` flat) tensor of the state's dtype to write into.
        method: ``"lut"`` (byte-LUT, eager), ``"lut_compiled"`` (byte-LUT through
            ``torch.compile``), ``"bnb"`` (``bitsandbytes.functional.dequantize_4bit``) or
            ``"triton"`` (one Triton kernel, CUDA only: ``ltx_mgpu.text.nf4_triton``).
        lut: the weight's :func:`nf4_byte_lut` (made from ``quant_state.code`` when omitted).

    Returns:
        ``out`` (viewed ``[N, K]``) or a new tensor; equal to bitsandbytes' dequantization.

    Raises:
        ValueError: an unknown method, no double quantization, or ``N*K`` not a multiple of the
            blocksize (for the LUT methods and ``"triton"``).
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
    if method == "triton":
        from ltx_mgpu.text.nf4_triton import UnitDequant

        UnitDequant([weight], [out.view(-1)])()
        return out
    if not qs.nested or (shape[0] * shape[1]) % qs.blocksize:
        raise ValueError("the byte-LUT dequant needs double quantization and N*K divisible by the blocksize")
    lut = nf4_byte_lut(qs.code) if lut is None else lut
    fn = _compiled_lut() if method == "lut_compiled" else _lut_impl
    # flat output: compiled graphs are then keyed by the weight's size only (3 for Gemma 3 12B)
    fn(weight.data, qs.absmax, qs.state2.code, qs.state2.absmax, qs.offset, lut, out.view(-1), qs.state2.blocksize)
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
        self.lut = nf4_byte_lut(original.weight.quant_state.code)  # [256, 2] float32, 2 KiB
        self._refs = (original, owner)  # a tuple: neither is registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        owner = self._refs[1]
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
        model: a ``Gemma3TextModel`` loaded by ``ltx_mgpu.text.nf4``.
        method: one of :data:`METHODS` (:func:`dequantize_nf4`; with ``"lut_compiled"`` a whole
            unit is dequantized by one compiled call, with ``"triton"`` by one kernel launch).
        scope: ``"layer"`` or ``"linear"``.
        prefetch: on CUDA, dequantize unit u+1 on a side stream into a second buffer while unit u
            computes (events order the buffer reuse); ignored on CPU.

    Extra device memory: one unit's weights in bf16, two with ``prefetch`` (Gemma 3 12B: a
    layer is 224 M weights = 449 MB, the largest projection 59 M = 118 MB). Outputs equal the
    ``Linear4bit`` path's up to the GEMM (``F.linear`` on the bf16 weights bitsandbytes
    dequantizes to).
    """

    def __init__(self, model: Any, method: Method = "lut_compiled", scope: Literal["layer", "linear"] = "layer",
                 prefetch: bool = False) -> None:
        import bitsandbytes as bnb

        if method not in METHODS or scope not in ("layer", "linear"):
            raise ValueError(f"method must be one of {METHODS} and scope 'layer' or 'linear'; got {method!r}, {scope!r}")
        self.method, self.scope = method, scope
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
        self._triton: dict[tuple[int, int], Any] = {}  # (unit, buffer) -> nf4_triton.UnitDequant
        self._view_cache: dict[tuple[int, int], list[torch.Tensor]] = {}  # (unit, buffer) -> weight views
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
        if self.method == "triton":
            key = (u, buf.data_ptr())
            launch = self._triton.get(key)
            if launch is None:
                from ltx_mgpu.text.nf4_triton import UnitDequant

                launch = self._triton[key] = UnitDequant([w.weight for w in unit], self._views(u, buf))
            launch()
            return
        if self.method == "lut_compiled":
            spans, start = [], 0
            for w in unit:
                spans.append((start, w.out_features * w.in_features))
                start += spans[-1][1]
            qss = [w.weight.quant_state for w in unit]
            weights = [(w.weight.data, qs.absmax, qs.state2.code, qs.state2.absmax, qs.offset, w.lut)
                       for w, qs in zip(unit, qss)]
            _compiled_lut_unit()(weights, buf, tuple(spans), qss[0].state2.blocksize)
            return
        for w, v in zip(unit, self._views(u, buf)):
            dequantize_nf4(w.weight, v, self.method, w.lut)

    def _begin(self, u: int) -> None:
        device = self.units[u][0].weight.device
        k = u % 2 if self.prefetch else 0
        buf = self._buffer(k, device)
        if self.prefetch and u == 0:
            # a forward starts: the side stream follows everything before it (which is what lets
            # a CUDA graph capture take its prefetches in: ltx_mgpu.text.graphs), and events
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
