"""The loaded LTX-2 denoiser: ltx-core 1.0.0's ``LTXModel`` + the two text embeddings
connectors, built from the files ComfyUI users have (see :mod:`ltx_mgpu.denoise.checkpoint` for
the layouts, fp8 and LoRA handling), ready for the sampler.

The transformer is built by ltx-core's ``SingleGPUModelBuilder`` + ``LTXModelConfigurator``
(keys renamed by ``LTXV_MODEL_COMFY_RENAMING_MAP`` for the monolith prefix) with our
memory-mapped :class:`~ltx_mgpu.denoise.checkpoint.StateDictLoader`. The connectors are
ltx-core ``Embeddings1DConnector`` modules built with ComfyUI's ``LTXAVModel`` settings
(double-precision RoPE, max position 4096, theta 1e4, split RoPE unless the config says
otherwise) so that :func:`ltx_mgpu.denoise.comfyui.conditioning.text_contexts` on them matches
ComfyUI's ``preprocess_text_embeds``. The attention of both computes ComfyUI's query / key
RMSNorm epsilon (:mod:`ltx_mgpu.denoise.comfyui.qk_norm`), set at load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from ltx_core.loader.sd_ops import SDOps
from ltx_core.loader.single_gpu_model_builder import SingleGPUModelBuilder
from ltx_core.model.transformer import LTXV_MODEL_COMFY_RENAMING_MAP, LTXModel, LTXModelConfigurator
from ltx_core.model.transformer.rope import LTXRopeType
from ltx_core.text_encoders.gemma.embeddings_connector import Embeddings1DConnector
from safetensors import safe_open
from safetensors.torch import save as _st_save

from ltx_mgpu.denoise.attention.function import attention_function, core_attention_type, install
from ltx_mgpu.denoise.checkpoint import (
    CONNECTORS,
    MONOLITH_PREFIX,
    CheckpointError,
    CheckpointInfo,
    StateDictLoader,
    connector_info,
    count_blocks,
    inspect_checkpoint,
    load_loras,
    packed_weight,
)
from ltx_mgpu.denoise.comfyui.qk_norm import use_comfy_qk_norm_eps
from ltx_mgpu.denoise.compiling import CompileCache, CompileWatch, graph_key
from ltx_mgpu.denoise.fp8 import (
    compile_blocks,
    fp8_linear_names,
    fp8_support_error,
    fp8_weight,
    swap_linears,
)
from ltx_mgpu.denoise.parallel.buckets import TokenBuckets, token_buckets
from ltx_mgpu.denoise.parallel.fsdp import shard_transformer
from ltx_mgpu.denoise.parallel.split import check_sequence_parallel_config
from ltx_mgpu.denoise.parallel.ulysses import SequenceParallelTransformer
from ltx_mgpu.denoise.plan import Fp8Config, LoraSpec, TransformerPlan
from ltx_mgpu.files import write_atomically
from ltx_mgpu.quantized.packed import LoraDelta, swap_packed_linears
from ltx_mgpu.shards import local_rows, local_tensor

__all__ = [
    "STOP_CHECKS",
    "LTXDenoiser",
    "check_world_size",
    "export_transformer_only",
    "load_ltx_model",
    "meta_transformer",
    "checkpoint_storage",
    "transformer_key",
    "transformer_sd_ops",
]

# --------------------------------------------------------------------------- the denoiser

#: How many times one transformer call asks whether to stop (:meth:`LTXDenoiser.stoppable`): at
#: every ``ceil(blocks / STOP_CHECKS)``-th block, so a call stops within that many blocks.
STOP_CHECKS = 8


@dataclasses.dataclass
class LTXDenoiser:
    """A loaded LTX-2 denoiser: everything the sampler needs, on one device.

    Attributes:
        transformer: ltx-core ``LTXModel`` (velocity model), eval mode.
        video_connector / audio_connector: ltx-core ``Embeddings1DConnector`` (None when the file
            has none: then only already-processed conditioning can be used).
        config: ``{"transformer": {...}}``; version: ``"2.0"`` / ``"2.3"``.
        dtype, device: of every weight but the e4m3 ones (``plan.compute_dtype``).
        plan: the :class:`~ltx_mgpu.denoise.plan.TransformerPlan` it was loaded by, its storage
            resolved from the file; ``max_tokens``, ``source``, ``loras``, ``weights`` and
            ``linears`` are its.
        compiles: with compiled blocks (``plan.compiled``: ``linears`` fp8, or compile ``on``),
            what announces and persists their compiles
            (:class:`~ltx_mgpu.denoise.compiling.CompileWatch`; set its ``on_compile`` to report
            them); else None.
        buckets: with compiled blocks, the video token buckets every call through
            :meth:`velocity_model` is padded to (``$LTX_MGPU_TOKEN_BUCKETS``,
            :mod:`ltx_mgpu.denoise.parallel.buckets`; None: off, and always for eager blocks).
    """

    transformer: LTXModel
    video_connector: Embeddings1DConnector | None
    audio_connector: Embeddings1DConnector | None
    config: dict
    version: str
    dtype: torch.dtype
    device: torch.device
    plan: TransformerPlan
    compiles: CompileWatch | None = None
    buckets: TokenBuckets | None = None

    @property
    def max_tokens(self) -> int:
        """The largest video (and audio) token count one call may have."""
        return self.plan.max_tokens

    @property
    def source(self) -> str:
        """The checkpoint path."""
        return self.plan.checkpoint

    @property
    def loras(self) -> tuple[LoraSpec, ...]:
        """The LoRAs merged at load."""
        return self.plan.loras

    @property
    def weights(self) -> str:
        """``"replicated"`` (every rank holds the whole transformer) or ``"sharded"`` (each rank a
        1/W shard of every weight, :mod:`ltx_mgpu.denoise.parallel.fsdp`)."""
        return self.plan.weights

    @property
    def linears(self) -> str:
        """How the block linears are held and run (``TransformerPlan.linears``: ``dense``,
        ``upcast``: e4m3 as stored, upcast per call, or ``fp8``: e4m3 GEMMs)."""
        return self.plan.linears

    @property
    def context_widths(self) -> tuple[int, int]:
        """(video, audio) width of ``Modality.context`` for this model: the caption-projection
        input (``caption_channels``) for 2.0, the inner dims for 2.3."""
        t = self.config["transformer"]
        if t.get("caption_proj_before_connector", False):
            return int(t["cross_attention_dim"]), int(t["audio_cross_attention_dim"])
        return int(t["caption_channels"]), int(t["caption_channels"])

    @property
    def latent_widths(self) -> tuple[int, int | None]:
        """(video, audio) values per latent token the transformer takes (its patchify
        projections' inputs: LTX-2's 128 video VAE channels, and 8 audio channels x 16 mel bins);
        audio None for a model without audio."""
        audio = getattr(self.transformer, "audio_patchify_proj", None)
        return self.transformer.patchify_proj.in_features, (audio.in_features if audio is not None else None)

    @contextlib.contextmanager
    def stoppable(self, should_stop: Callable[[], bool]) -> Iterator[Callable[[], bool]]:
        """Within the block, a transformer call can stop midway: every
        ``ceil(blocks / STOP_CHECKS)``-th transformer block first calls ``should_stop()``; once it
        says True, that block and every later one of the call return their inputs unchanged
        (their module hooks still run: FSDP2 gathers and frees a sharded block's weights as
        usual, so its state stays in step), the call ends at once with meaningless outputs, and
        the yielded ``stopped()`` is True: the caller discards them. In a pool ``should_stop``
        is the cancel decision, a collective every rank reaches at the same blocks (every rank
        runs every block of a call, under any layout). The blocks' own ``forward`` (compiled or
        not) is restored on leaving."""
        blocks = list(self.transformer.transformer_blocks)
        stride = max(1, math.ceil(len(blocks) / STOP_CHECKS))
        state = {"stopped": False}
        saved = []
        for i, block in enumerate(blocks):
            own = block.__dict__.get("forward")  # torch.compile'd forward (compile_blocks), or None

            def forward(*args, _run=own or block.forward, _check=i % stride == 0, **kwargs):
                if not state["stopped"] and _check and should_stop():
                    state["stopped"] = True
                if state["stopped"]:
                    return kwargs.get("video", args[0] if args else None), kwargs.get("audio", args[1] if len(args) > 1
                                                                                     else None)
                return _run(*args, **kwargs)

            saved.append((block, own))
            block.forward = forward
        try:
            yield lambda: state["stopped"]
        finally:
            for block, own in saved:
                if own is None:
                    block.__dict__.pop("forward", None)
                else:
                    block.forward = own

    def velocity_model(self, group=None):
        """The transformer behind ltx_mgpu's sequence-parallel wrapper (world size 1: plain
        path plus the ``max_tokens`` check), split as the plan's ``layout`` says, each call padded
        to its token bucket when the blocks are compiled (:attr:`buckets`). Every rank of
        ``group`` must call it."""
        return SequenceParallelTransformer(self.transformer, group, self.plan.max_tokens, layout=self.plan.layout,
                                           buckets=self.buckets)


def _connector(info: CheckpointInfo, loader: StateDictLoader, name: str, device) -> Embeddings1DConnector:
    t = info.config["transformer"]
    side = "audio_" if name.startswith("audio") else ""
    shapes = {k[len(name) + 1:]: v for k, v in info.shapes.items() if k.startswith(name + ".")}
    q = shapes["transformer_1d_blocks.0.attn1.to_q.weight"]
    head_dim = t.get(f"{side}connector_attention_head_dim", t.get("connector_attention_head_dim", 128))
    gate = shapes.get("transformer_1d_blocks.0.attn1.to_gate_logits.weight")
    if gate is None and q[0] % head_dim:
        raise CheckpointError(f"{name} is {q[0]} wide, not a multiple of its head size {head_dim}; fix the config")
    heads = gate[0] if gate is not None else q[0] // head_dim
    with torch.device("meta"):
        conn = Embeddings1DConnector(
            attention_head_dim=q[0] // heads, num_attention_heads=heads,
            num_layers=count_blocks(shapes, "transformer_1d_blocks."), positional_embedding_theta=10000.0,
            positional_embedding_max_pos=[4096],
            num_learnable_registers=shapes["learnable_registers"][0] if "learnable_registers" in shapes else None,
            rope_type=LTXRopeType(t.get("rope_type", "split")), double_precision_rope=True,
            apply_gated_attention=gate is not None,
        )
    full = info.prefix + name + "."
    sd = loader.load(info.path, SDOps(f"LTX2_{name}").with_matching(prefix=full).with_replacement(full, ""), device).sd
    conn.load_state_dict(sd, strict=True, assign=True)
    return conn.eval()


def checkpoint_storage(info: CheckpointInfo) -> str:
    """How the checkpoint stores the blocks' linears: the ``storage`` a
    :class:`~ltx_mgpu.denoise.plan.TransformerPlan` of it resolves to: ``"ggml"`` (a GGUF file
    whose block linears are quantized, :func:`~ltx_mgpu.denoise.checkpoint.packed_weight`),
    ``"comfy_quant"`` (ComfyUI's nvfp4 / int8 block linears), ``"e4m3"`` (an fp8 file: some are
    float8 e4m3) or ``"dense"``."""
    if any(packed_weight(k, t) for k, t in info.ggml_types.items()):
        return "ggml"
    if any(packed_weight(k, q.describe()) for k, q in info.quant.items()):
        return "comfy_quant"
    return "e4m3" if any(fp8_weight(k, info.shapes[k], compute=False) for k in info.e4m3_keys) else "dense"


def load_ltx_model(plan: TransformerPlan, device: str | torch.device = "cpu", *, group=None,
                   info: CheckpointInfo | None = None) -> LTXDenoiser:
    """Load an LTX-2 / 2.3 denoiser (transformer + connectors) as ``plan`` says, LoRAs merged.

    Args:
        plan: what to load and how (checkpoint, dtype, weights, LoRAs, token budget, attention
            backend, the connectors' file when not the checkpoint's; ``storage`` None is resolved
            here from the file's header). Its
            ``linears`` decide the block linears (:mod:`ltx_mgpu.denoise.fp8`): ``fp8``: e4m3
            GEMMs, the file's e4m3 weights and scales as stored, other weights quantised per row
            at load after their LoRAs are merged, the blocks compiled (``torch.compile``, one
            graph per token count: the first call at a size compiles); ``upcast`` (a sharded fp8
            file): the e4m3 block weights kept as stored (FSDP2 gathers them at one byte) and
            upcast per call; ``dense``: every weight in the compute dtype (a replicated fp8 file
            is upcast at load). Its ``compile`` ``on`` compiles the blocks of any dense or fp8
            file in any dtype as ``fp8`` compiles them. Compiled blocks get token buckets
            (``$LTX_MGPU_TOKEN_BUCKETS``, :attr:`LTXDenoiser.buckets`): nearby sizes share one graph.
        device: target device; tensors are read from the memory-mapped file one at a time
            and moved there, so host RAM holds at most one tensor per rank.
        group: the process group of the shards (``weights: sharded``; None: the default group;
            every rank of it must load together, each reading only its rows of every weight).
            The connectors are whole either way.
        info: the checkpoint's header (:func:`inspect_checkpoint`), when the caller has read it.
    Returns:
        ``LTXDenoiser`` in eval mode, its ``plan`` with the storage resolved.
    Raises:
        FileNotFoundError: no checkpoint. CheckpointError: see ``inspect_checkpoint`` and
        LoRA errors, weights that do not fit the config (missing/unexpected keys, a shape that
        differs: checked before any weight is read), or a tensor holding NaN or infinite values
        (``StateDictLoader``: checked as it is read).
        ValueError: ``linears`` ``fp8`` on a device without FP8 tensor cores (the message names
        the fix), or a ``$LTX_MGPU_TOKEN_BUCKETS`` that is not 0 or a power of two.
    """
    device = torch.device(device)
    info = info if info is not None else inspect_checkpoint(plan.checkpoint)
    if plan.storage is None:
        plan = plan.with_storage(checkpoint_storage(info))
    if plan.linears == "fp8" and (err := fp8_support_error(device)):
        raise ValueError(err)
    buckets = token_buckets() if plan.compiled else None  # only compiled blocks have graphs to share
    dtype = getattr(torch, plan.compute_dtype)
    if plan.attention_type is not None:  # ltx-core builds with one of its own; ours is installed below
        info.config["transformer"]["attention_type"] = core_attention_type(plan.attention_type)
    conn_info = connector_info(plan.connectors, info) if plan.connectors is not None else info
    weight_keys = [k for k in {**info.shapes, **conn_info.shapes} if k.endswith(".weight")]
    deltas = load_loras(plan.loras, weight_keys)
    loader = StateDictLoader(info, dtype, deltas, exclude=tuple(c + "." for c in CONNECTORS))
    sd_ops = transformer_sd_ops(info)
    builder = SingleGPUModelBuilder(
        model_class_configurator=LTXModelConfigurator, model_path=info.path, model_sd_ops=sd_ops, model_loader=loader
    )
    meta = builder.meta_model(info.config, ()).state_dict()
    _check_shapes(info, meta)
    expected = set(meta)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if plan.weights == "sharded" or plan.linears != "dense":
        group = (group if group is not None else dist.group.WORLD) if plan.weights == "sharded" else None
        transformer = _assembled_transformer(builder, info, loader, sd_ops, device, group, plan.fp8,
                                             packed=plan.linears == "packed")
    else:
        transformer = builder.build(device=device)
    got = set(loader.loaded_keys)
    if expected != got:
        missing, extra = sorted(expected - got), sorted(got - expected)
        raise CheckpointError(
            f"{info.path}: the weights do not fit the {info.config_source} LTX-{info.version} config "
            f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
            f"{'...' if len(extra) > 3 else ''}). Use a file with correct 'config' metadata."
        )
    connectors = (None, None)
    if conn_info is not info:  # the connectors of another file
        conn_loader = StateDictLoader(conn_info, dtype, deltas)
        connectors = tuple(_connector(conn_info, conn_loader, name, device) for name in CONNECTORS)
        loader.fused |= conn_loader.fused
    elif info.has_connectors:
        loader.exclude = ()
        connectors = tuple(_connector(info, loader, name, device) for name in CONNECTORS)
    unfused = set(deltas) - loader.fused
    if unfused:  # only weights outside the DiT and connectors could be left; never drop them silently
        raise CheckpointError(f"LoRA targets {sorted(unfused)[:3]} were not loaded into the model")
    ours = plan.attention_type is not None and core_attention_type(plan.attention_type) != plan.attention_type
    if ours:
        install(transformer, attention_function(plan.attention_type))
    for module in (transformer, *connectors):  # ComfyUI's attention norms (before any compile bakes them in)
        if module is not None:
            use_comfy_qk_norm_eps(module)
    compiles = None
    if plan.compiled:
        compile_blocks(transformer, dynamic=False)
        cache = CompileCache.open(graph_key(transformer, device, layout=plan.layout, world_size=world,
                                            attention=plan.attention_type if ours else ""))
        if cache is not None:
            cache.load_all()
        compiles = CompileWatch(transformer, cache, world, bucketed=buckets is not None)
    return LTXDenoiser(transformer.eval(), *connectors, info.config, info.version, dtype, device, plan, compiles,
                       buckets)


def _check_shapes(info: CheckpointInfo, params: dict) -> None:
    """Raise ``CheckpointError`` naming the first weight of the file whose (logical) shape is not
    the one its parameter has in the model ``info.config`` builds (``params``: the meta model's
    state dict), before any weight is read: a replicated load would fail in ltx-core's
    ``load_state_dict``, a sharded one copying a rank's rows, neither naming the fix."""
    file_keys = {transformer_key(info, k): k for k in info.shapes}
    for name, p in params.items():
        key = file_keys.get(name)
        if key is not None and tuple(info.shapes[key]) != tuple(p.shape):
            raise CheckpointError(
                f"{info.path}: {info.prefix}{key} is {list(info.shapes[key])}; the {info.config_source} "
                f"LTX-{info.version} config makes it {list(p.shape)}: the file is damaged or its weights belong to "
                "another model than its config (download it again, or use a file with correct 'config' metadata)")


def _assembled_transformer(builder, info: CheckpointInfo, loader: StateDictLoader, sd_ops, device: torch.device,
                           group, fp8: Fp8Config | None, packed: bool = False) -> LTXModel:
    """The transformer built on the meta device, its block linears made :class:`Float8Linear`
    (``fp8.compute`` ``"fp8"``: all of :func:`~ltx_mgpu.denoise.fp8.fp8_linear_names`; ``"upcast"``:
    those the file stores as e4m3; None: none) or, with ``packed``, :class:`PackedLinear` (those a
    GGUF file stores quantized, or a file's ComfyUI nvfp4 / int8 layers), sharded over ``group``
    (None: whole), then given storage on
    ``device`` and filled from the file: a shard reads only its rows, e4m3 weights and GGML blocks
    stay as stored, nothing else is read or materialised."""
    transformer = builder.meta_model(info.config, ()).to(loader.dtype)  # every weight in the compute dtype
    fp8_names = []
    file_keys = {transformer_key(info, k): k for k in info.shapes}
    if fp8 is not None:
        compute = fp8.compute == "fp8"
        fp8_names = [n for n in fp8_linear_names(transformer, compute=compute)
                     if compute or file_keys.get(n + ".weight") in info.e4m3_keys]
        swap_linears(transformer, fp8, fp8_names)
    packed_names = {}
    if packed:
        packed_names = {name: info.stored_type(key) for name, m in transformer.named_modules()
                        if type(m) is torch.nn.Linear and (key := file_keys.get(name + ".weight")) is not None
                        and packed_weight(key, info.stored_type(key))}
        swap_packed_linears(transformer, packed_names)
    if group is not None:
        shard_transformer(transformer, group, device)
    transformer.to_empty(device=device)
    params = dict(transformer.named_parameters())
    loader.rows = {name: r for name, p in params.items() if (r := local_rows(p)) is not None}
    loader.keep_e4m3 = {n + ".weight" for n in fp8_names}
    loader.keep_packed = {n + ".weight" for n in packed_names}
    layers = set(fp8_names)
    loaded: list[str] = []
    # one block at a time: the device holds the model plus one block as read, never a second model
    groups: dict[str, list[str]] = {}
    for name in params:
        head = ".".join(name.split(".")[:2]) if name.startswith("transformer_blocks.") else ""
        groups.setdefault(head, []).append(name)
    with torch.no_grad():
        for names in groups.values():
            sd = loader.load(info.path, _Only(sd_ops, info.prefix, set(names)), device).sd
            loaded += loader.loaded_keys
            for name in names:
                if name not in sd:  # a missing weight: reported with the others below
                    continue
                layer = name[: -len(".weight")] if name.endswith(".weight") else None
                if layer in layers:
                    fused = file_keys.get(name) in loader.loras  # merged with a LoRA: round stochastically
                    transformer.get_submodule(layer).set_weight(sd.pop(name), loader.scales.pop(name, None),
                                                                stochastic_key=name if fused else None)
                elif layer in packed_names:  # the file's blocks or rows, its LoRAs merged per call
                    module = transformer.get_submodule(layer)
                    module.set_packed(sd.pop(name), *loader.packed_scales.pop(name, (None, None)))
                    module.loras = tuple(LoraDelta.of(b, a, s) for a, b, s in loader.packed_deltas.pop(name, ()))
                else:
                    local_tensor(params[name]).copy_(sd.pop(name))
            del sd
    loader.rows, loader.keep_e4m3, loader.keep_packed, loader.loaded_keys = {}, frozenset(), frozenset(), loaded
    return transformer


class _Only:
    """An ``sd_ops`` for :class:`StateDictLoader`: ``ops``' renaming (None: the key less
    ``prefix``), keeping only the renamed keys in ``names``."""

    def __init__(self, ops, prefix: str, names: set[str]):
        self.ops, self.prefix, self.names = ops, prefix, names

    def apply_to_key(self, key: str) -> str | None:
        new = self.ops.apply_to_key(key) if self.ops is not None else key[len(self.prefix):]
        return new if new in self.names else None


def transformer_key(info: CheckpointInfo, key: str) -> str | None:
    """The ltx-core ``LTXModel`` parameter name of the prefix-less checkpoint key ``key`` (None
    for a key the transformer does not take, such as a connector's)."""
    ops = transformer_sd_ops(info)
    return ops.apply_to_key(info.prefix + key) if ops is not None else key


def transformer_sd_ops(info: CheckpointInfo) -> SDOps | None:
    """The key renaming from the checkpoint's keys to ltx-core ``LTXModel`` parameter names:
    ``LTXV_MODEL_COMFY_RENAMING_MAP`` for the monolith prefix, the prefix stripped for another,
    None (keys as stored) without one."""
    prefix = info.prefix
    if prefix == MONOLITH_PREFIX:
        return LTXV_MODEL_COMFY_RENAMING_MAP
    return SDOps("LTX2_DIT_PREFIX").with_matching(prefix=prefix).with_replacement(prefix, "") if prefix else None


def meta_transformer(info: CheckpointInfo) -> LTXModel:
    """The checkpoint's ``LTXModel`` on the meta device: no weight is read, no memory is used.

    For checks that need only the config (head counts, model type) before any load.

    Raises:
        CheckpointError: the config does not build an ltx-core 1.0.0 LTX-2 transformer.
    """
    try:
        with torch.device("meta"):
            return LTXModelConfigurator.from_config(info.config)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(
            f"{info.path}: its {info.config_source} config does not describe an LTX-2 transformer ltx-core "
            f"1.0.0 can build ({type(e).__name__}: {e}). Use a file with correct 'config' metadata."
        ) from None


def check_world_size(info: CheckpointInfo, world_size: int) -> None:
    """Raise ``SequenceParallelConfigError`` unless ``world_size`` ranks can split this model.

    The same check (and message: which GPU counts work) as ``SequenceParallelTransformer``
    makes, from the config alone (:func:`meta_transformer`), so a pool can refuse a checkpoint
    before reading its weights.

    Raises:
        SequenceParallelConfigError: ``world_size`` does not divide the video or audio heads.
        CheckpointError: see :func:`meta_transformer`.
    """
    check_sequence_parallel_config(meta_transformer(info), int(world_size))


# --------------------------------------------------------------------------- writing


def export_transformer_only(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    prefix: str = MONOLITH_PREFIX,
    keep_config: bool = True,
    fp8: str | None = None,
) -> Path:
    """Write the DiT (transformer + connectors) of ``src`` as a transformer-only file.

    The layouts ComfyUI users keep in ``models/diffusion_models/``. Atomic (temp + rename).

    Args:
        src: a monolith (or another DiT file). dst: output path.
        prefix: ``"model.diffusion_model."`` or ``""`` (no prefix).
        keep_config: store ``config`` (``{"transformer": ...}``) metadata, or none.
        fp8: None (keep dtypes), ``"cast"`` (2-D block weights stored float8_e4m3fn) or
            ``"scaled"`` (ComfyUI scaled fp8: ``weight / s`` as float8_e4m3fn plus a float32
            ``scale_weight`` s = max|w| / 448 per weight, and the ``scaled_fp8`` marker).
    """
    info = inspect_checkpoint(src)
    if fp8 not in (None, "cast", "scaled"):
        raise ValueError(f"fp8 must be None, 'cast' or 'scaled', got {fp8!r}")
    out: dict[str, torch.Tensor] = {}
    with safe_open(info.path, framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
            if not key.startswith(info.prefix):
                continue
            full = key[len(info.prefix):]
            t = f.get_tensor(key)
            if fp8 and t.ndim == 2 and full.startswith("transformer_blocks.") and full.endswith(".weight"):
                if fp8 == "scaled":
                    s = t.float().abs().amax().clamp_min(1e-12) / torch.finfo(torch.float8_e4m3fn).max
                    out[prefix + full[: -len("weight")] + "scale_weight"] = s.reshape(())
                    t = t.float() / s
                t = t.to(torch.float8_e4m3fn)
            out[prefix + full] = t.contiguous()
    if fp8 == "scaled":
        out[prefix + "scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    meta = {"config": json.dumps(info.config)} if keep_config else None
    dst = Path(dst)
    return write_atomically(dst, _st_save(out, metadata=meta))
