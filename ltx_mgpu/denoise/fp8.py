"""FP8 linear layers for the LTX-2 transformer: fp8 weight storage, and FP8 tensor-core compute.

:class:`Float8Linear` replaces a block's ``torch.nn.Linear`` (module swap on ltx-core's model,
never a fork of its code) and holds the weight as float8 e4m3 with a float32 scale per output
row (``weight ~= weight_fp8 * weight_scale[:, None]``), the bias in the compute dtype. It
computes one of two ways (:class:`~ltx_mgpu.denoise.plan.Fp8Config`, which the transformer's
plan gives: ``TransformerPlan.fp8``):

* ``compute="upcast"``: the weight is upcast to the input's dtype for every call
  (``(weight_fp8.float() * scale).to(dtype)``, exactly the cast the loader makes for a replicated
  model; on a CUDA device with Triton in one launch, :func:`ltx_mgpu.quantized.kernels.upcast_e4m3`)
  and ``F.linear`` runs in that dtype. This is fp8 *storage*: half the bytes of bf16 held
  and, for sharded weights (:mod:`ltx_mgpu.denoise.parallel.fsdp`), gathered: FSDP2 all-gathers the
  fp8 parameter as it is held, and the upcast runs after the gather.
* ``compute="fp8"``: an e4m3 x e4m3 GEMM on the tensor cores (``torch._scaled_mm``, PyTorch's
  cuBLASLt / CUTLASS FP8 GEMM) with a dynamic activation scale, the output in the compute dtype.
  ``scaling="row"``: one scale per token (row of the activation) and one per output channel of
  the weight (the rowwise kernel); ``"tensor"``: one per tensor each (cuBLASLt's tensorwise
  kernel; the weight's rows then share one scale). ``bias_epilogue`` adds the bias inside the
  GEMM's epilogue instead of as a separate op. The activation's quantisation (amax, divide,
  cast) is ordinary torch code: under :func:`compile_blocks` inductor fuses it into the kernel
  that produces the activation (the RMS norm and AdaLN modulation before q/k/v and the
  feed-forward, the GELU before the second feed-forward GEMM).

Which linears are swapped (:func:`fp8_linear_names`): for FP8 compute every ``nn.Linear`` inside
``transformer_blocks`` whose two sizes are multiples of 16 (what the FP8 GEMMs require) and at
least :data:`MIN_FEATURES`: the attention projections and the feed-forwards of video and
audio; for fp8 storage every block linear the file stores as e4m3. Norms, AdaLN tables, the
patchify / output projections, the timestep embedders and the connectors stay in the compute
dtype.

Formats: e4m3 (OCP 8-bit floating point specification, ``E4M3``: max normal 448, PyTorch's
``torch.float8_e4m3fn``). A quantised value is ``clamp(x / s, -448, 448)`` cast with
round-to-nearest-even, ``s = amax / 448``; a weight merged with a LoRA is rounded
stochastically instead (:func:`quantize_rows`), as ComfyUI rounds its fp8 merges.

Compiling (:func:`compile_blocks`, FP8 compute): the first call at each token count compiles
the blocks before it runs, and a Stop is seen only after that call; later calls at the size
run compiled. The loader keeps the compiles across pools and announces a first one
(:mod:`ltx_mgpu.denoise.compiling`), and pads every call up to a token bucket so nearby sizes
share one compile (:mod:`ltx_mgpu.denoise.parallel.buckets`).
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from ltx_core.guidance.perturbations import BatchedPerturbationConfig, PerturbationType
from ltx_core.model.transformer.attention import AttentionFunction
from ltx_core.model.transformer.transformer import BasicAVTransformerBlock

from ltx_mgpu.denoise.attention.function import traceable
from ltx_mgpu.denoise.plan import Fp8Config
from ltx_mgpu.quantized import kernels
from ltx_mgpu.shards import local_rows, local_tensor

__all__ = ["E4M3_MAX", "MIN_FEATURES", "BlockPerturbations", "Float8Linear", "compile_blocks",
           "fp8_linear_names", "fp8_support_error", "fp8_weight", "rounding_noise", "quantize_rows", "swap_linears"]

#: The largest finite e4m3 value (``torch.finfo(torch.float8_e4m3fn).max``).
E4M3_MAX = 448.0
#: The smallest amax a scale is computed from (an all-zero row gets scale ``_TINY / 448``).
_TINY = 1e-12
#: Smallest in / out size of a swapped linear: smaller GEMMs gain nothing from FP8.
MIN_FEATURES = 256
#: Compiled graphs Dynamo keeps per code object under :func:`compile_blocks` (its default is 8).
_RECOMPILE_LIMIT = 1024


def fp8_support_error(device: torch.device) -> str | None:
    """None when ``device`` has FP8 tensor cores (CUDA compute capability 8.9: Ada, or newer:
    Hopper, Blackwell) and this torch runs the layers' GEMM there (tried once, on a tiny input),
    else the message naming the fix."""
    device = torch.device(device)
    if device.type != "cuda":
        return (f"dtype 'fp8' computes on FP8 tensor cores (an NVIDIA Ada, Hopper or newer GPU); this pool runs on "
                f"{device.type.upper()}: choose dtype 'bf16' (an fp8 checkpoint is then upcast to bf16)")
    cap = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if cap < (8, 9):
        return (f"dtype 'fp8' needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell); "
                f"{name} is {cap[0]}.{cap[1]}: choose dtype 'bf16' (or 'fp16')")
    try:  # the GEMM the layers run (rowwise scales, bias), tiny: cuBLAS / CUTLASS lack it on some GPUs
        a = torch.ones(32, 64, device=device).to(torch.float8_e4m3fn)
        b = torch.ones(32, 64, device=device).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(32, 1, device=device), scale_b=torch.ones(1, 32, device=device),
                         bias=torch.zeros(32, device=device, dtype=torch.bfloat16), out_dtype=torch.bfloat16,
                         use_fast_accum=True)
    except RuntimeError as e:
        return (f"dtype 'fp8': this torch {torch.__version__} cannot run the rowwise-scaled FP8 GEMM on {name} "
                f"({str(e).splitlines()[0][:200]}): choose dtype 'bf16'")
    return None


def quantize_rows(weight: torch.Tensor, scale: torch.Tensor | None = None,
                  noise: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, s)``: ``weight`` ``[out, in]`` (any float dtype) as e4m3 ``q`` ``[out, in]`` and float32
    ``s`` ``[out]`` with ``weight ~= q * s[:, None]``: ``s = max|row| / 448`` per row, or ``scale``
    when given (``[out]`` or one value, broadcast: a stored fp8 file's scale, or one scale for
    the tensor). Rounds to nearest; with ``noise`` (uniform [0, 1), ``weight``'s shape)
    stochastically: each value becomes one of its two e4m3 neighbours with the probability that
    makes the expected value exact (as ComfyUI rounds merged LoRA weights to fp8), so a small
    LoRA delta survives on average instead of being rounded away."""
    w = weight.float()
    if scale is None:
        scale = w.abs().amax(dim=1).clamp_min(_TINY) / E4M3_MAX
    scale = scale.to(device=w.device, dtype=torch.float32).reshape(-1).expand(w.shape[0]).contiguous()
    x = (w / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX)
    q = x.to(torch.float8_e4m3fn)
    if noise is None:
        return q, scale
    bits = q.view(torch.uint8).to(torch.int16)
    near = q.float()
    # the other neighbour: one step of magnitude toward x (e4m3fn magnitudes are ordered by their
    # 7 low bits; 0x7E is 448, 0x7F NaN), with x's sign (RTN may have given a signed zero)
    mag = (bits & 0x7F) + torch.where(x.abs() > near.abs(), 1, -1)
    other_bits = (mag.clamp(0, 0x7E) | torch.where(x < 0, 0x80, 0)).to(torch.uint8)
    other = other_bits.view(torch.float8_e4m3fn).float()
    p = ((x - near).abs() / (other - near).abs().clamp_min(_TINY)).nan_to_num_(0.0)
    pick = noise.to(device=x.device, dtype=torch.float32) < p
    return torch.where(pick, other_bits, q.view(torch.uint8)).view(torch.float8_e4m3fn), scale


def rounding_noise(key: str, shape, device) -> torch.Tensor:
    """The uniform noise :func:`quantize_rows` rounds the weight ``key`` of the whole ``shape``
    with: seeded by the key alone, so every rank, world size and reload draws the same values
    (a shard takes its rows)."""
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(key.encode()))
    return torch.rand(tuple(shape), generator=gen, device=device)


class Float8Linear(torch.nn.Module):
    """A ``torch.nn.Linear`` with an e4m3 weight (module doc).

    Parameters, without gradients (inference only): ``weight`` e4m3 ``[out, in]``,
    ``weight_scale`` float32 ``[out]`` and ``bias`` ``[out]`` (compute dtype, or None); sharded
    (FSDP2's ``Shard(0)``), a rank holds the same rows of the weight and of its scales.
    Input ``[..., in]`` in the compute dtype, output ``[..., out]`` in the same dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, config: Fp8Config,
                 device=None):
        super().__init__()
        self.in_features, self.out_features, self.config = in_features, out_features, config
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                     device=device), requires_grad=False)
        self.weight_scale = torch.nn.Parameter(torch.ones(out_features, dtype=torch.float32, device=device),
                                               requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
                     if bias else None)

    def extra_repr(self) -> str:
        c = self.config
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"compute={c.compute}" + (f", scaling={c.scaling}" if c.compute == "fp8" else ""))

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor, scale: torch.Tensor | None = None, *,
                   stochastic_key: str | None = None) -> None:
        """Hold ``weight`` (this rank's rows of it, when the weight is sharded: ``[rows, in]``):
        an e4m3 tensor is kept as is with its ``scale`` (``[rows]`` or one value; None: 1), a float
        one is quantised per row (:func:`quantize_rows`; rounded stochastically with the noise of
        ``stochastic_key``, :func:`rounding_noise`, when given: merged LoRA weights).

        Under ``compute="fp8", scaling="tensor"`` the weight gets one scale (requantised from a
        per-row one); that needs the whole weight (not a shard).

        Raises:
            ValueError: per-tensor scaling of a sharded weight.
        """
        target = local_tensor(self.weight)
        rows = local_rows(self.weight)
        tensorwise = self.config.compute == "fp8" and self.config.scaling == "tensor"
        if tensorwise and rows is not None:
            raise ValueError("per-tensor fp8 scaling needs whole weights; shard with scaling 'row'")
        if weight.dtype == torch.float8_e4m3fn:
            scale = torch.ones(1) if scale is None else scale
            s = scale.to(device=target.device, dtype=torch.float32).reshape(-1).expand(weight.shape[0])
            if not tensorwise or bool((s == s[:1]).all()):
                target.copy_(weight)
                local_tensor(self.weight_scale).copy_(s)
                return
            weight = weight.float() * s[:, None]
        noise = None
        if stochastic_key is not None:
            noise = rounding_noise(stochastic_key, self.weight.shape, target.device)
            noise = noise if rows is None else noise[rows]
        one = weight.float().abs().amax().clamp_min(_TINY) / E4M3_MAX if tensorwise and weight.numel() else None
        q, s = quantize_rows(weight, one, noise)
        target.copy_(q)
        local_tensor(self.weight_scale).copy_(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.compute == "upcast":
            if kernels.available(x.device) and self.weight.is_contiguous():  # one launch, the same values
                w = kernels.upcast_e4m3(self.weight, self.weight_scale, x.dtype)
            else:
                w = (self.weight.float() * self.weight_scale[:, None]).to(x.dtype)
            return F.linear(x, w, self.bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.shape[0] == 0:  # no tokens: the FP8 GEMMs refuse empty operands
            return x.new_zeros(*shape[:-1], self.out_features)
        if c.scaling == "row":
            x_scale = x2.abs().amax(dim=1, keepdim=True).float().clamp_min(_TINY) / E4M3_MAX
            w_scale = self.weight_scale[None, :]
        else:
            x_scale = x2.abs().amax().float().clamp_min(_TINY) / E4M3_MAX
            # set_weight gave every row the one scale; a reduction, as inductor lowers it (a 0-d view it did not)
            w_scale = self.weight_scale.amax()
        xq = (x2.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        bias = self.bias if c.bias_epilogue else None
        y = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=w_scale, bias=bias, out_dtype=x.dtype,
                             use_fast_accum=c.fast_accum)
        if self.bias is not None and not c.bias_epilogue:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def fp8_weight(key: str, shape, compute: bool = True) -> bool:
    """Whether the weight ``key`` (a transformer parameter or prefix-less checkpoint key) of
    ``shape`` is a block linear's that is made fp8: inside ``transformer_blocks``, 2-D, and for
    FP8 compute both sizes multiples of 16 and at least :data:`MIN_FEATURES` (module doc); for fp8
    storage (``compute=False``) any size."""
    if not (key.startswith("transformer_blocks.") and key.endswith(".weight") and len(shape) == 2):
        return False
    return not compute or (min(shape) >= MIN_FEATURES and shape[0] % 16 == 0 and shape[1] % 16 == 0)


def fp8_linear_names(model: torch.nn.Module, compute: bool = True) -> list[str]:
    """The names (in ``model.named_modules()``) of the ``nn.Linear`` layers inside
    ``model.transformer_blocks`` that :func:`swap_linears` replaces (:func:`fp8_weight`)."""
    return [name for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and fp8_weight(name + ".weight", m.weight.shape, compute)]


def swap_linears(model: torch.nn.Module, config: Fp8Config, names: list[str] | None = None) -> list[str]:
    """Replace the linears ``names`` (default :func:`fp8_linear_names`) of ``model`` by
    :class:`Float8Linear` ones in place; returns the names.

    On the meta device the new layers are empty shells to be filled (``set_weight``); on a real
    device each layer's weight is quantised from the one it replaces (:func:`quantize_rows`) and
    the old one is freed, one layer at a time. The bias keeps its dtype.
    """
    names = fp8_linear_names(model) if names is None else names
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        dtype = old.bias.dtype if old.bias is not None else old.weight.dtype
        new = Float8Linear(old.in_features, old.out_features, old.bias is not None, dtype, config,
                           device=old.weight.device)
        if old.weight.device.type != "meta":
            new.set_weight(old.weight)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        setattr(parent, child, new)
    return names


class BlockPerturbations:
    """ltx-core's :class:`~ltx_core.guidance.perturbations.BatchedPerturbationConfig` as one
    block sees it: the same answers to the queries ``BasicAVTransformerBlock.forward`` makes
    (``all_in_batch``, ``any_in_batch``, ``mask``, ``mask_like``), computed for ``block`` when
    made, so that the queries ignore the block index they are passed.

    Why: the block passes its ``self.idx`` to every query, and Dynamo treats an int attribute of
    a module as a constant it guards on (``self.idx == 0``; torch 2.9 guards it even for an
    empty config, where the queries' generator expressions capture it), so each of the identical
    blocks failed the previous block's guards and was traced and compiled again. With this view
    in its place the traced code reads only the per-sample flags (constants: blocks perturbed
    alike share one graph).

    ``perturbations``: the config or None (nothing perturbed, as the block takes None);
    ``batch``: the samples (the config's length when given). Masks are 1 for a kept sample and 0
    for a skipped one, in the ``dtype`` / on the ``device`` asked, as ltx-core makes them.
    """

    def __init__(self, perturbations: BatchedPerturbationConfig | None, block: int, batch: int):
        configs = perturbations.perturbations if perturbations is not None else [None] * batch
        self.skipped = {t: tuple(c is not None and c.is_perturbed(t, block) for c in configs)
                        for t in PerturbationType}

    def all_in_batch(self, perturbation_type: PerturbationType, block: int) -> bool:
        return all(self.skipped[perturbation_type])

    def any_in_batch(self, perturbation_type: PerturbationType, block: int) -> bool:
        return any(self.skipped[perturbation_type])

    def mask(self, perturbation_type: PerturbationType, block: int, device, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([0.0 if s else 1.0 for s in self.skipped[perturbation_type]], device=device, dtype=dtype)

    def mask_like(self, perturbation_type: PerturbationType, block: int, values: torch.Tensor) -> torch.Tensor:
        mask = self.mask(perturbation_type, block, values.device, values.dtype)
        return mask.view(mask.numel(), *([1] * (values.ndim - 1)))


def _shared_graph_forward(block: BasicAVTransformerBlock, compiled):
    """``forward(video, audio, perturbations=None)`` of ``block``: ``compiled`` (its compiled
    forward) given the :class:`BlockPerturbations` of ``block.idx`` instead of ``perturbations``."""

    def forward(video, audio, perturbations=None):
        if video is None and audio is None:  # the block's own error
            return compiled(video, audio, perturbations)
        batch = (video if video is not None else audio).x.shape[0]
        return compiled(video, audio, BlockPerturbations(perturbations, block.idx, batch))

    return forward


def compile_blocks(model: torch.nn.Module, dynamic: bool | None = None) -> int:
    """``torch.compile`` every transformer block's ``forward`` (the module call, with its hooks
    such as FSDP2's gathers, stays eager); returns how many. ltx-core's blocks are alike, so one
    compiled graph serves them all, per code object and input shapes (inductor fuses each
    activation's FP8 quantisation into the kernel that produces it): an ltx-core
    ``BasicAVTransformerBlock`` gets its perturbations as :class:`BlockPerturbations`, so no
    graph depends on the block's index; an ltx-core ``AttentionFunction`` member in a block's
    attention modules is replaced by the same call in a form Dynamo traces
    (:func:`~ltx_mgpu.denoise.attention.function.traceable`: no graph break). The
    sequence-parallel attention wrappers (token exchange, padded keys cut) are one opaque
    operator each (:mod:`ltx_mgpu.denoise.parallel.ulysses`). ``dynamic``: ``torch.compile``'s
    (None: a second token count recompiles with symbolic shapes; False: one compiled graph per token
    count)."""
    blocks = list(model.transformer_blocks)
    # One graph per token count, layout and batch (and per code object, should a graph break
    # remain): a pool that meets many sizes must not reach the limits, past which Dynamo would
    # run the blocks eagerly.
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, _RECOMPILE_LIMIT)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 16 * _RECOMPILE_LIMIT)
    for block in blocks:
        for module in block.modules():  # ltx-core's enum attention functions, as a call Dynamo traces
            if isinstance(getattr(module, "attention_function", None), AttentionFunction):
                module.attention_function = traceable(module.attention_function)
        compiled = torch.compile(block.forward, dynamic=dynamic)
        shared = isinstance(block, BasicAVTransformerBlock)
        block.forward = _shared_graph_forward(block, compiled) if shared else compiled
    return len(blocks)
