"""LTX-2 checkpoint files: inspection, config inference, LoRA reading and a state-dict loader.

What :mod:`ltx_mgpu.denoise.model` builds the denoiser from. Sources
(ComfyUI's ``comfy/model_detection.py`` and ``comfy/supported_models.py``; ltx-core 1.0.0's
``ltx_core/loader/`` and ``ltx_core/model/transformer/``):

* a **monolith** ``models/checkpoints/ltx-2*.safetensors``: the DiT under
  ``model.diffusion_model.*`` (connectors under ``model.diffusion_model.{video,audio}_
  embeddings_connector.*``), plus VAE / projection keys we ignore; ``config`` metadata;
* a **transformer-only** file from ``models/diffusion_models/``: the same DiT keys, either
  under ``model.diffusion_model.`` or with no prefix (ComfyUI's
  ``unet_prefix_from_state_dict``: the prefix counts when more than 5 keys carry it), with or
  without ``config`` metadata. Without it the transformer config is inferred from tensor
  shapes (:func:`infer_transformer_config`);
* a **GGUF** transformer file (``models/unet`` or ``models/diffusion_models``, as ComfyUI-GGUF's
  converters write them: the same DiT keys as tensor names, GGML-quantized weights, the
  ``config`` metadata as a string field when the converter kept it), read with the ``gguf``
  package (:mod:`ltx_mgpu.quantized.ggml`). Its quantized block linears can stay packed
  (``keep_packed``), the rest is dequantized at load;
* any of the safetensors layouts with **ComfyUI's quantized layers** (a ``comfy_quant`` marker per
  layer: nvfp4, int8 with or without ConvRot, fp8; :mod:`ltx_mgpu.quantized.layers`, e.g. an
  ``fp4_mixed`` or ``int8_convrot`` transformer). Its nvfp4 and int8 block linears can stay packed
  as rows (:mod:`ltx_mgpu.quantized.rows`); every other quantized layer is dequantized at load
  as ComfyUI computes it (comfy-kitchen, :mod:`ltx_mgpu.quantized.dequant`).

:func:`inspect_checkpoint` reads only the header (keys, shapes, metadata). :class:`StateDictLoader`
is an ltx-core ``StateDictLoader`` that reads one tensor at a time through safetensors' memory
map straight onto the target device (N ranks never hold N host copies of the file), upcasts fp8
(plain casts, ComfyUI ``scale_weight`` / ``weight_scale`` scaled fp8, ltx-core's
``weight_scale`` fp8) and fuses LoRAs.

LoRA fusion follows ComfyUI (``comfy/lora.py``): ``W += strength * alpha/rank * (B @ A)`` in
float32, then a plain cast to the model dtype; key forms ``diffusion_model.<m>``,
``transformer.<m>`` and ``lora_unet_<m with _>``, each with ``lora_A/lora_B`` or
``lora_down/lora_up`` and an optional ``alpha``. ltx-core 1.0.0's ``apply_loras`` is not used:
it rejects float32 weights, ignores ``alpha``, knows only ``lora_A/B`` and leaves the
connectors unfused. Fusion is deterministic, so every rank builds bit-identical weights.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from ltx_core.loader.primitives import StateDict
from ltx_core.loader.sd_ops import SDOps
from safetensors import safe_open

from ltx_mgpu.denoise.plan import LoraSpec
from ltx_mgpu.files import json_metadata, safetensors_header
from ltx_mgpu.finite import FiniteCheck, is_finite
from ltx_mgpu.quantized import dequant
from ltx_mgpu.quantized.ggml import READABLE, GGMLFormatError, GGUFFile, dequantize, open_gguf
from ltx_mgpu.quantized.layers import LayerQuant, QuantFormatError, read_file_quant
from ltx_mgpu.quantized.packed import is_packed_type
from ltx_mgpu.quantized.rows import ROW_FORMATS, RowFormatError, pack_rows

__all__ = [
    "ASSUMED_HEAD_DIMS",
    "CONNECTORS",
    "MONOLITH_PREFIX",
    "CheckpointError",
    "CheckpointInfo",
    "StateDictLoader",
    "check_loras",
    "connector_info",
    "count_blocks",
    "infer_transformer_config",
    "inspect_checkpoint",
    "is_gguf_file",
    "packed_weight",
    "load_loras",
]

MONOLITH_PREFIX = "model.diffusion_model."
CONNECTORS = ("video_embeddings_connector", "audio_embeddings_connector")
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# Per-weight side tensors of the quantized formats (ComfyUI legacy fp8 / ComfyUI quant / ltx-core).
_AUX_SUFFIXES = (".scale_weight", ".scale_input", ".weight_scale", ".input_scale", ".comfy_quant", ".weight_scale_2",
                 ".pre_quant_scale")
_LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_down.weight": "A", ".lora_B.weight": "B", ".lora_up.weight": "B",
                  ".alpha": "alpha"}

# Values ltx-core's LTXModelConfigurator requires (check_config_value) plus the LTX-2 constants
# no tensor shape encodes; these are the values of every released LTX-2 / 2.3 config.
_LTX2_FIXED = {
    "dropout": 0.0, "attention_bias": True, "num_vector_embeds": None, "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 1000, "use_linear_projection": False, "only_cross_attention": False,
    "cross_attention_norm": True, "double_self_attention": False, "upcast_attention": False,
    "standardization_norm": "rms_norm", "norm_elementwise_affine": False, "qk_norm": "rms_norm",
    "positional_embedding_type": "rope", "use_audio_video_cross_attention": True, "share_ff": False,
    "av_cross_ada_norm": True, "use_middle_indices_grid": True, "norm_eps": 1e-6,
    "positional_embedding_theta": 10000.0, "positional_embedding_max_pos": [20, 2048, 2048],
    "audio_positional_embedding_max_pos": [20], "timestep_scale_multiplier": 1000,
    "av_ca_timestep_scale_multiplier": 1000.0, "rope_type": "split", "frequencies_precision": "float64",
    "causal_temporal_positioning": True, "connector_positional_embedding_max_pos": [4096],
}
#: Head sizes assumed when a checkpoint has no gate logits to count heads with (LTX-2.0):
#: video 128, audio 64 (the 19B model: 32 x 128 / 32 x 64), connectors 128 (ComfyUI's default).
ASSUMED_HEAD_DIMS = {"video": 128, "audio": 64, "connector": 128}


class CheckpointError(ValueError):
    """A checkpoint or LoRA file that cannot be loaded as an LTX-2 denoiser; says what to fix."""


@dataclasses.dataclass
class CheckpointInfo:
    """What :func:`inspect_checkpoint` learns from a file's header (no tensor is read).

    Attributes:
        path: the file.
        prefix: the DiT key prefix (``"model.diffusion_model."``, ``"model."`` or ``""``).
        config: ``{"transformer": {...}}`` for ``LTXModelConfigurator``.
        config_source: ``"metadata"`` or ``"inferred"``.
        version: ``"2.0"`` (caption projections in the DiT) or ``"2.3"``.
        shapes: prefix-less DiT key -> shape (quantisation side tensors left out).
        e4m3_keys: the prefix-less keys stored as float8 e4m3 (``F8_E4M3``).
        ggml_types: a GGUF file's prefix-less keys -> GGML type (``Q4_K``, ``F32``...); empty
            for a safetensors file.
        quant: a safetensors file's prefix-less weight keys -> how ComfyUI quantized them
            (``comfy_quant`` markers; their ``shapes`` are the logical ones); empty without any.
    """

    path: str
    prefix: str
    config: dict
    config_source: str
    version: str
    shapes: dict[str, tuple[int, ...]]
    e4m3_keys: frozenset[str] = frozenset()
    ggml_types: dict[str, str] = dataclasses.field(default_factory=dict)
    quant: dict[str, LayerQuant] = dataclasses.field(default_factory=dict)

    def stored_type(self, key: str) -> str | None:
        """How the prefix-less ``key`` is stored when it is quantized: its GGML type, or its ComfyUI
        format (``LayerQuant.describe()``: ``"nvfp4"``, ``"int8_tensorwise+convrot256"``...); None
        for a plain tensor."""
        if key in self.ggml_types:
            return self.ggml_types[key]
        q = self.quant.get(key)
        return q.describe() if q is not None else None

    @property
    def is_gguf(self) -> bool:
        """Whether the file is GGUF (else safetensors)."""
        return bool(self.ggml_types)

    @property
    def has_connectors(self) -> bool:
        return all(any(k.startswith(c + ".") for k in self.shapes) for c in CONNECTORS)


# --------------------------------------------------------------------------- inspection


def _detect_prefix(keys: Sequence[str]) -> str:
    """ComfyUI's ``unet_prefix_from_state_dict`` + ``load_diffusion_model_state_dict`` rule."""
    for prefix in (MONOLITH_PREFIX, "model."):
        if sum(k.startswith(prefix) for k in keys) > 5:
            return prefix
    return ""


def count_blocks(shapes: Mapping, stem: str) -> int:
    """How many numbered blocks ``<stem><i>.`` the keys of ``shapes`` hold (max index + 1; 0 if none)."""
    pat = re.compile(re.escape(stem) + r"(\d+)\.")
    found = {int(m.group(1)) for k in shapes if (m := pat.match(k))}
    return max(found) + 1 if found else 0


def _heads(shapes: Mapping, attn: str, inner: int, head_dim_key: str, what: str) -> tuple[int, int]:
    """(heads, head_dim) of attention module ``attn``: gate logits count heads; else assume."""
    gate = shapes.get(f"{attn}.to_gate_logits.weight")
    if gate is not None:
        heads = gate[0]
    else:
        hd = ASSUMED_HEAD_DIMS[head_dim_key]
        if inner % hd:
            raise CheckpointError(
                f"cannot infer the {what} attention heads: the checkpoint stores no config metadata and no gate "
                f"logits (an LTX-2.0 layout), and its {what} width {inner} is not a multiple of the LTX-2 head size "
                f"{hd}. Use the full checkpoint (models/checkpoints) or a file that keeps the 'config' metadata."
            )
        heads = inner // hd
    if inner % heads:
        raise CheckpointError(f"{what} width {inner} is not divisible by its {heads} heads (gate logits)")
    return heads, inner // heads


def infer_transformer_config(shapes: Mapping[str, Sequence[int]]) -> dict:
    """The ``"transformer"`` config of an LTX-2 DiT from its (prefix-less) tensor shapes.

    Read from shapes: layer counts, widths, in/out channels, caption projection (present ->
    LTX-2.0 layout with ``caption_channels``; absent -> 2.3 ``caption_proj_before_connector``),
    gated attention (``to_gate_logits``, whose rows also count the heads), cross-attention AdaLN
    (``prompt_adaln_single``), connector geometry and register count. Assumed: the LTX-2
    constants in ``_LTX2_FIXED`` (split float64 RoPE, theta 1e4, max positions [20, 2048, 2048] /
    [20], timestep multipliers 1000) and, without gate logits, the head sizes
    ``ASSUMED_HEAD_DIMS`` (video 128, audio 64, connector 128).

    Raises:
        CheckpointError: not an LTX-2 audio-video DiT, or the heads cannot be inferred.
    """
    need = ("adaln_single.emb.timestep_embedder.linear_1.bias", "audio_adaln_single.linear.weight",
            "patchify_proj.weight", "audio_patchify_proj.weight", "transformer_blocks.0.attn2.to_k.weight")
    missing = [k for k in need if k not in shapes]
    if missing:
        raise CheckpointError(
            "not an LTX-2 audio-video transformer: pick an LTX-2 / LTX-2.3 checkpoint (this file lacks "
            f"{', '.join(missing)} after the key prefix)"
        )
    cfg = dict(_LTX2_FIXED)
    vin, ain = shapes["patchify_proj.weight"][0], shapes["audio_patchify_proj.weight"][0]
    vh, vd = _heads(shapes, "transformer_blocks.0.attn1", vin, "video", "video")
    ah, ad = _heads(shapes, "transformer_blocks.0.audio_attn1", ain, "audio", "audio")
    cfg.update(
        num_layers=count_blocks(shapes, "transformer_blocks."),
        num_attention_heads=vh, attention_head_dim=vd, audio_num_attention_heads=ah, audio_attention_head_dim=ad,
        in_channels=shapes["patchify_proj.weight"][1], out_channels=shapes["proj_out.weight"][0],
        audio_in_channels=shapes["audio_patchify_proj.weight"][1],
        audio_out_channels=shapes["audio_proj_out.weight"][0],
        cross_attention_dim=shapes["transformer_blocks.0.attn2.to_k.weight"][1],
        audio_cross_attention_dim=shapes["transformer_blocks.0.audio_attn2.to_k.weight"][1],
        apply_gated_attention="transformer_blocks.0.attn1.to_gate_logits.weight" in shapes,
        cross_attention_adaln="prompt_adaln_single.linear.weight" in shapes,
    )
    if "caption_projection.linear_1.weight" in shapes:
        cfg["caption_channels"] = shapes["caption_projection.linear_1.weight"][1]
    else:
        cfg.update(caption_proj_before_connector=True, caption_projection_first_linear=False,
                   caption_projection_second_linear=False, caption_proj_input_norm=False)
    for side, conn in (("", "video_embeddings_connector"), ("audio_", "audio_embeddings_connector")):
        q = shapes.get(f"{conn}.transformer_1d_blocks.0.attn1.to_q.weight")
        if q is None:
            continue
        h, d = _heads(shapes, f"{conn}.transformer_1d_blocks.0.attn1", q[0], "connector", f"{conn}")
        cfg[f"{side}connector_num_attention_heads"], cfg[f"{side}connector_attention_head_dim"] = h, d
        cfg[f"{side}connector_num_layers"] = count_blocks(shapes, f"{conn}.transformer_1d_blocks.")
        if not side:
            cfg["connector_apply_gated_attention"] = (f"{conn}.transformer_1d_blocks.0.attn1.to_gate_logits.weight"
                                                      in shapes)
            if f"{conn}.learnable_registers" in shapes:
                cfg["connector_num_learnable_registers"] = shapes[f"{conn}.learnable_registers"][0]
    return cfg


def _version(tcfg: dict) -> str:
    return "2.3" if tcfg.get("caption_proj_before_connector", False) else "2.0"


def packed_weight(key: str, qtype: str | None) -> bool:
    """Whether the checkpoint weight ``key`` stored as ``qtype`` (:meth:`CheckpointInfo.stored_type`)
    is kept packed: a block linear's weight (``transformer_blocks.*.weight``, 2-D) in a GGML type of
    :data:`ltx_mgpu.quantized.packed.PACKED_TYPES` or a ComfyUI row format (nvfp4, int8)."""
    return is_packed_type(qtype) and key.startswith("transformer_blocks.") and key.endswith(".weight")


def is_gguf_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a GGUF file (its first four bytes are ``GGUF``)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def _gguf_header(path: str) -> tuple[str, dict, dict, dict]:
    """``(prefix, shapes, ggml types, metadata)`` of a GGUF DiT file (the header only).

    Raises:
        CheckpointError: not a readable GGUF file, not a diffusion model's (another
            ``general.architecture``: a text model's GGUF given as the transformer), or a tensor
            of a GGML type not read here (named, with the types that are).
    """
    try:
        f = open_gguf(path)
    except GGMLFormatError as e:
        raise CheckpointError(f"{e}; give an LTX-2 GGUF transformer (models/unet or models/diffusion_models)") from None
    arch = f.architecture
    if arch not in (None, "ltxv", "ltxav"):
        raise CheckpointError(f"{path}: a GGUF file of architecture {arch!r}, not an LTX-2 transformer (ltxv); give "
                              "an LTX-2 GGUF transformer, and a Gemma GGUF to the Gemma Loader")
    unread = next(((t.name, t.qtype) for t in f.tensors.values() if t.qtype not in READABLE), None)
    if unread is not None:
        raise CheckpointError(f"{path}: tensor {unread[0]} is {unread[1]}, which ltx_mgpu does not read (it reads "
                              f"{', '.join(READABLE)}); use a GGUF of one of those types (Q8_0, Q6_K, Q5_K_M, Q4_K_M, "
                              "Q4_K_S...)")
    keys = list(f.tensors)
    prefix = _detect_prefix(keys)
    dit = {k: t for k, t in f.tensors.items() if k.startswith(prefix)}
    shapes = {k[len(prefix):]: t.shape for k, t in dit.items()}
    types = {k[len(prefix):]: t.qtype for k, t in dit.items()}
    config = f.field("config")
    return prefix, shapes, types, ({"config": config} if isinstance(config, str) else {})


def connector_info(path: str | os.PathLike, transformer: CheckpointInfo) -> CheckpointInfo:
    """The text connectors of ``path`` for ``transformer`` (a transformer file without them): a
    :class:`CheckpointInfo` of ``path`` holding only its connector keys (``shapes``), with
    ``transformer``'s config. ``path`` may be an LTX-2 checkpoint or transformer file, or
    ComfyUI's embeddings-connector file (``ltx-2-19b-embeddings_connector_*.safetensors``: the
    connectors under ``model.diffusion_model.``, beside the text projection), which is how the
    LTX-2.0 GGUF transformers ship their connectors.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: not a readable safetensors file, or no LTX-2 text connectors in it.
    """
    path = str(path)
    if not Path(path).is_file():
        raise FileNotFoundError(f"no connectors file at {path}")
    keys, _ = safetensors_header(path, CheckpointError, "; give a file holding LTX-2's text connectors (the "
                                 "checkpoint, or an embeddings-connector file)")
    prefix = next((p for p in (MONOLITH_PREFIX, "") if any(k.startswith(p + CONNECTORS[0] + ".") for k in keys)), None)
    if prefix is None or not any(k.startswith(prefix + CONNECTORS[1] + ".") for k in keys):
        raise CheckpointError(f"{path} holds no LTX-2 text connectors ({', '.join(CONNECTORS)}); give the LTX-2 "
                              "checkpoint or the embeddings-connector file that goes with this transformer")
    with safe_open(path, framework="pt", device="cpu") as f:
        shapes = {k[len(prefix):]: tuple(f.get_slice(k).get_shape()) for k in keys
                  if k.startswith(tuple(prefix + c + "." for c in CONNECTORS)) and not k.endswith(_AUX_SUFFIXES)}
    return CheckpointInfo(path, prefix, transformer.config, "connectors", transformer.version, shapes)


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointInfo:
    """Read a checkpoint's header: key layout, config (stored or inferred) and version.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: a directory, not an LTX-2 DiT, unreadable config metadata, a caption-projection
            variant ltx-core 1.0.0 cannot build, or shapes that do not determine the config.
    """
    path = str(path)
    if Path(path).is_dir():  # e.g. --checkpoint and --gemma swapped
        raise CheckpointError(f"{path} is a directory (a Gemma snapshot?); an LTX-2 checkpoint is one .safetensors "
                              "file (models/checkpoints or models/diffusion_models)")
    if not Path(path).is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    types: dict[str, str] = {}
    e4m3: frozenset[str] = frozenset()
    quant: dict[str, LayerQuant] = {}
    if is_gguf_file(path):
        prefix, shapes, types, meta = _gguf_header(path)
    else:
        keys, meta = safetensors_header(path, CheckpointError, "; give an LTX-2 checkpoint (models/checkpoints or "
                                        "models/diffusion_models)")
        prefix = _detect_prefix(keys)
        try:
            layers = read_file_quant(path, prefix=prefix, hint="; use a bf16, fp8, nvfp4 or int8 file").layers
        except QuantFormatError as e:
            raise CheckpointError(str(e)) from None
        quant = {layer[len(prefix):] + ".weight": q for layer, q in layers.items()}
        with safe_open(path, framework="pt", device="cpu") as f:
            dit = [k for k in keys
                   if k.startswith(prefix) and not k.endswith(_AUX_SUFFIXES) and k[len(prefix):] != "scaled_fp8"]
            shapes = {k[len(prefix):]: tuple(f.get_slice(k).get_shape()) for k in dit}
            e4m3 = frozenset(k[len(prefix):] for k in dit if f.get_slice(k).get_dtype() == "F8_E4M3")
        shapes.update({k: q.logical_shape(shapes[k]) for k, q in quant.items() if k in shapes})
    stored = (json_metadata(meta, "config", path, CheckpointError, "; give the file its 'config' metadata again, or "
                            "remove it (the config is then inferred from the shapes)") or {}).get("transformer")
    if stored is not None and not isinstance(stored, dict):
        raise CheckpointError(f"{path}: the 'config' metadata's 'transformer' is a {type(stored).__name__}, not an "
                              "object; give the file its 'config' metadata again, or remove it")
    if stored:
        tcfg, source = dict(stored), "metadata"
        if "num_layers" not in tcfg:
            tcfg["num_layers"] = count_blocks(shapes, "transformer_blocks.")
    else:
        try:
            tcfg, source = infer_transformer_config(shapes), "inferred"
        except CheckpointError as e:
            raise CheckpointError(f"{path}: no 'config' metadata, and {e}") from None
    if tcfg.get("caption_proj_before_connector") and tcfg.get("caption_projection_first_linear", False):
        raise CheckpointError(
            f"{path}: caption_projection_first_linear=True is an LTX-2 variant ltx-core 1.0.0 cannot build"
        )
    return CheckpointInfo(path, prefix, {"transformer": tcfg}, source, _version(tcfg), shapes, e4m3, types, quant)


# --------------------------------------------------------------------------- LoRA


def _lora_aliases(weight_keys: Sequence[str]) -> dict[str, str]:
    """ComfyUI's LoRA key map (``model_lora_keys_unet``): LoRA module name -> DiT weight key."""
    out = {}
    for k in weight_keys:
        m = k[: -len(".weight")]
        for alias in (f"diffusion_model.{m}", f"transformer.{m}", "lora_unet_" + m.replace(".", "_")):
            out[alias] = k
    return out


#: The part names of a LoRA pair, for messages.
_LORA_PART_NAMES = {"A": "lora_A", "B": "lora_B", "alpha": "alpha"}
#: The safetensors dtypes a LoRA tensor may have.
_LORA_DTYPES = ("F16", "BF16", "F32", "F64")
_LORA_HINT = "; give a LoRA .safetensors file (models/loras), or download it again if it is damaged"

#: A LoRA file's layout from its header: DiT weight key -> part ("A", "B", "alpha") -> (stored key, shape).
LoraLayout = dict[str, dict[str, tuple[str, tuple[int, ...]]]]


def _lora_layout(spec: LoraSpec, aliases: Mapping[str, str]) -> LoraLayout:
    """Read and check a LoRA file's header (no tensor data is read).

    Raises:
        CheckpointError: no such file; not a readable safetensors file (not safetensors,
            truncated, a damaged header); a key that is not a LoRA key of this DiT; a part given
            twice; a tensor that is not float; a pair with only one of A/B, a factor that is
            not 2-D or has an empty dimension, ranks that disagree, or an alpha that is not one
            number. Each names the file and the fix.
    """
    if not math.isfinite(spec.strength):
        raise CheckpointError(f"LoRA {spec.path}: strength {spec.strength} is not a finite number")
    if not Path(spec.path).is_file():
        raise CheckpointError(f"no LoRA file at {spec.path}")
    safetensors_header(spec.path, CheckpointError, _LORA_HINT)
    where = f"LoRA {spec.path}"
    parts: LoraLayout = {}
    unknown = []
    with safe_open(spec.path, framework="pt", device="cpu") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
            suffix = next((s for s in _LORA_SUFFIXES if key.endswith(s)), None)
            target = aliases.get(key[: -len(suffix)]) if suffix else None
            if target is None:
                unknown.append(key)
                continue
            part, info = _LORA_SUFFIXES[suffix], f.get_slice(key)
            if part in parts.setdefault(target, {}):
                raise CheckpointError(f"{where}: {target} has two {_LORA_PART_NAMES[part]} tensors "
                                      f"({parts[target][part][0]} and {key}); keep one naming per module")
            if info.get_dtype() not in _LORA_DTYPES:
                raise CheckpointError(f"{where}: {key} is stored as {info.get_dtype()}; LoRA tensors are float "
                                      "(F16, BF16, F32, F64)")
            parts[target][part] = (key, tuple(info.get_shape()))
    if unknown:
        raise CheckpointError(
            f"LoRA {spec.path}: {len(unknown)} key(s) match no weight of this LTX-2 transformer, e.g. "
            f"{', '.join(unknown[:3])}. Is it a LoRA for this model version (LTX-2.0 vs 2.3)?"
        )
    for target, p in sorted(parts.items()):
        if "A" not in p or "B" not in p:
            raise CheckpointError(f"LoRA {spec.path}: {target} has only one of lora_A/lora_B (down/up)")
        (_, a), (_, b) = p["A"], p["B"]
        for name, shape in (("lora_A", a), ("lora_B", b)):
            if len(shape) < 2:
                raise CheckpointError(f"{where}: {target} {name} is {shape}: a LoRA factor is 2-D ([rank, in] for "
                                      "lora_A, [out, rank] for lora_B); the file is not a LoRA of this format")
            if 0 in shape:
                raise CheckpointError(f"{where}: {target} {name} is {shape}: every dimension must be at least 1")
        if a[0] != math.prod(b[1:]):
            raise CheckpointError(f"{where}: {target} lora_A is {a} (rank {a[0]}) but lora_B {b} (rank "
                                  f"{math.prod(b[1:])}); the two factors of a pair share their rank: the file is "
                                  "damaged or mixes two LoRAs")
        if "alpha" in p and math.prod(p["alpha"][1]) != 1:
            raise CheckpointError(f"{where}: {target} alpha is {p['alpha'][1]}, not one number")
    return parts


def check_loras(specs: Sequence[LoraSpec], weight_shapes: Mapping[str, Sequence[int]]) -> None:
    """Check LoRA files against a DiT from their headers alone (no tensor data is read), as
    :func:`load_loras` will use them: each pair's update ``B @ A`` must have its weight's shape.
    Strength-0 LoRAs are skipped (they are not loaded). Deterministic, so a pool runs it on
    every rank before any weight is read.

    Args:
        weight_shapes: prefix-less DiT key -> shape (``CheckpointInfo.shapes``).
    Raises:
        CheckpointError: as :func:`_lora_layout`, or an update of another shape than its weight.
    """
    aliases = _lora_aliases([k for k in weight_shapes if k.endswith(".weight")])
    for spec in specs:
        if spec.strength == 0:
            continue
        for target, p in sorted(_lora_layout(spec, aliases).items()):
            update = (p["B"][1][0], math.prod(p["A"][1][1:]))
            weight = tuple(weight_shapes[target])
            if (update != weight) if len(weight) == 2 else (math.prod(update) != math.prod(weight)):
                raise CheckpointError(f"LoRA {spec.path}: {target} gives a {update} update for a {weight} weight; "
                                      "is it a LoRA for this model (LTX-2.0 vs 2.3, another size)?")


def load_loras(specs: Sequence[LoraSpec], weight_keys: Sequence[str]) -> dict[str, list]:
    """DiT weight key -> [(A float32 [r, in], B float32 [out, r], scale)], on CPU.

    ``scale = strength * alpha / rank`` (``alpha`` optional, as in ComfyUI). Strength-0 LoRAs
    are skipped. Raises CheckpointError for a missing or unreadable file, a key that is not a
    LoRA key of this DiT (never silently dropped), an incomplete or malformed A/B pair (see
    :func:`_lora_layout`; :func:`check_loras` also checks the shapes against the weights), or
    values that are not finite.
    """
    aliases = _lora_aliases(weight_keys)
    out: dict[str, list] = {}
    for spec in specs:
        if spec.strength == 0:
            continue
        layout = _lora_layout(spec, aliases)
        with safe_open(spec.path, framework="pt", device="cpu") as f:
            for target, p in sorted(layout.items()):
                t = {part: f.get_tensor(key).float() for part, (key, _) in p.items()}
                bad = next((part for part in ("A", "B", "alpha") if part in t and not bool(t[part].isfinite().all())),
                           None)
                if bad is not None:
                    raise CheckpointError(f"LoRA {spec.path}: {target} {_LORA_PART_NAMES[bad]} holds NaN or infinite "
                                          "values; the file is damaged: download it again or re-train it")
                a, b = t["A"].flatten(1), t["B"].flatten(1)
                alpha = float(t["alpha"].reshape(())) / a.shape[0] if "alpha" in t else 1.0
                out.setdefault(target, []).append((a, b, float(spec.strength) * alpha))
    return out


# --------------------------------------------------------------------------- state-dict loader


class StateDictLoader:
    """ltx-core ``StateDictLoader`` for an LTX-2 DiT file: mmap reads, fp8 upcast, LoRA fusion.

    ``metadata(path)`` returns the (stored or inferred) config. ``load(path, sd_ops, device)``
    reads the keys ``sd_ops`` keeps (minus ``exclude`` prefixes of the renamed key), one tensor
    at a time onto ``device``: fp8 weights are multiplied by their scale (``scale_weight`` or
    ``weight_scale``, broadcast) in float32, LoRA deltas are added in float32, and the result is
    cast to ``dtype``. ``loaded_keys`` records the renamed keys of the last ``load``.

    ``rows`` (renamed key -> ``slice`` of dim 0) makes ``load`` read only those rows of a weight
    from the file (its scale rows and LoRA up-matrix rows with it): a rank's shard of a sharded
    transformer (``ltx_mgpu.denoise.parallel.fsdp``).

    ``keep_e4m3`` (renamed keys): those weights, when stored as float8 e4m3 and given no LoRA, are
    returned as stored (e4m3, not upcast), their float32 scale (``[rows]`` or one value; None
    for a plain cast) in ``scales[key]``: for fp8 layers (``ltx_mgpu.denoise.fp8``).

    A GGUF file's tensors are dequantized (:func:`ltx_mgpu.quantized.ggml.dequantize`, float32),
    LoRAs fused and cast the same way; ``keep_packed`` (renamed keys) are returned as the file's
    ``uint8`` block rows instead, their LoRAs in ``packed_deltas[key]`` (``up``, ``down``,
    strength) to be merged per call (``ltx_mgpu.quantized.packed``). Every GGUF tensor is checked for
    NaN and infinite values as it is read (a packed one dequantized once for it).

    A ComfyUI nvfp4 or int8 layer (``CheckpointInfo.quant``) in ``keep_packed`` is returned as its
    packed rows (:func:`ltx_mgpu.quantized.rows.pack`: a shard reads only its rows of the weight),
    nvfp4's per-tensor and column scales in ``packed_scales[key]``, its LoRAs in
    ``packed_deltas[key]``; any other quantized layer is dequantized as ComfyUI computes it
    (:func:`ltx_mgpu.quantized.dequant.dequantize`, in ``dtype``), its LoRAs fused in float32.
    Their scales (and a dequantized weight) are checked for NaN and infinite values.

    Every tensor read (weights and scales of every format, the connectors' included) and every
    weight computed from it (upcast by its scale, fused with its LoRAs) is checked finite
    (:class:`ltx_mgpu.finite.FiniteCheck`: one reduction each, read back once per ``load``), and
    ``load`` raises ``CheckpointError`` naming the first key that is not: a file that lies is
    refused, never loaded to give NaN velocities.
    """

    def __init__(self, info: CheckpointInfo, dtype: torch.dtype, loras: dict[str, list], exclude: tuple[str, ...] = (),
                 rows: dict[str, slice] | None = None, keep_e4m3: frozenset[str] | set[str] = frozenset(),
                 keep_packed: frozenset[str] | set[str] = frozenset()):
        self.info, self.dtype, self.loras, self.exclude = info, dtype, loras, exclude
        self.rows = rows or {}
        self.keep_e4m3 = keep_e4m3
        self.keep_packed = keep_packed
        self.scales: dict[str, torch.Tensor | None] = {}
        self.packed_deltas: dict[str, list[tuple[torch.Tensor, torch.Tensor, float]]] = {}
        self.packed_scales: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self.loaded_keys: list[str] = []
        self.fused: set[str] = set()
        self._gguf: GGUFFile | None = None
        self._finite = FiniteCheck()

    def metadata(self, path: str) -> dict:  # noqa: ARG002 - the protocol passes the path
        return self.info.config

    def load(self, path, sd_ops: SDOps | None = None, device: torch.device | None = None) -> StateDict:
        sd = self._load(path, sd_ops, device)
        bad = self._finite.first()
        if bad is not None:
            raise CheckpointError(f"{self.info.path}: {bad} holds NaN or infinite values; the file is damaged: "
                                  "download it again")
        return sd

    def _load(self, path, sd_ops: SDOps | None = None, device: torch.device | None = None) -> StateDict:
        device = device or torch.device("cpu")
        paths = path if isinstance(path, (list, tuple)) else [path]
        prefix, sd, dtypes, size = self.info.prefix, {}, set(), 0
        if self.info.is_gguf:
            for key in self._gguf_file().tensors:
                full = key[len(prefix):] if key.startswith(prefix) else None
                new = None if full is None else sd_ops.apply_to_key(key) if sd_ops is not None else full
                if new is None or new.startswith(self.exclude):
                    continue
                t = self._gguf_tensor(key, full, new, device)
                sd[new] = t
                dtypes.add(t.dtype)
                size += t.nbytes
            self.loaded_keys = list(sd)
            return StateDict(sd=sd, device=device, size=size, dtype=dtypes)
        for p in paths:
            with safe_open(str(p), framework="pt", device="cpu") as f:
                names = set(f.keys())
                for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    full = key[len(prefix):] if key.startswith(prefix) else None
                    if full is None or key.endswith(_AUX_SUFFIXES) or full == "scaled_fp8":
                        continue
                    new = sd_ops.apply_to_key(key) if sd_ops is not None else full
                    if new is None or new.startswith(self.exclude):
                        continue
                    t = self._tensor(f, names, key, full, device, self.rows.get(new), new)
                    sd[new] = t
                    dtypes.add(t.dtype)
                    size += t.nbytes
        self.loaded_keys = list(sd)
        return StateDict(sd=sd, device=device, size=size, dtype=dtypes)

    def _gguf_file(self) -> GGUFFile:
        if self._gguf is None:
            self._gguf = open_gguf(self.info.path)
        return self._gguf

    def _gguf_tensor(self, key: str, full: str, new: str, device: torch.device) -> torch.Tensor:
        """One GGUF tensor (module doc): this rank's ``rows`` of it, dense or packed."""
        f = self._gguf_file()
        info, rows = f.tensors[key], self.rows.get(new)
        data = f.read(key)
        if rows is not None and len(info.shape) > 1:  # whole rows of blocks: slice the bytes
            data = data[rows]
        data = data.to(device, copy=True)  # out of the read-only file mapping
        shape = (data.shape[0], *info.shape[1:]) if len(info.shape) > 1 else info.shape
        w = dequantize(data, info.qtype, shape)
        if len(info.shape) == 1 and rows is not None:
            w = w[rows]
        if not is_finite(w):
            raise CheckpointError(f"{self.info.path}: tensor {key} holds NaN or infinite values; the file is damaged: "
                                  "download it again")
        deltas = self.loras.get(full, ())
        if new in self.keep_packed:
            if deltas:
                self.packed_deltas[new] = list(deltas)
                self.fused.add(full)
            return data
        return self._fused(w, full, rows, device).to(self.dtype)

    def _quantized(self, f, key: str, full: str, quant: LayerQuant, device: torch.device, rows: slice | None,
                   new: str | None) -> torch.Tensor:
        """A ComfyUI nvfp4 / int8 layer's weight: packed rows, or dense (class doc)."""
        stem, shape = key[: -len(".weight")], self.info.shapes[full]
        packed = new in self.keep_packed
        part = f.get_slice(key)
        parts = {"weight": (part[rows.start:rows.stop] if packed and rows is not None else f.get_tensor(key))}
        parts.update({p: f.get_tensor(f"{stem}.{p}") for p in quant.parts})
        deltas = self.loras.get(full, ())
        if packed:
            try:
                data, tensor_scale, column_scale = pack_rows(quant, parts, shape, rows, where=key)
            except RowFormatError as e:
                raise CheckpointError(f"{self.info.path}: {e}") from None
            if quant.format == "mxfp8":  # its elements are e4m3, which has NaN codes (the scales: pack_rows)
                self._finite.add(key, parts["weight"].view(torch.float8_e4m3fn))
            self.packed_scales[new] = (tensor_scale if tensor_scale is None else tensor_scale.to(device),
                                       column_scale if column_scale is None else column_scale.to(device))
            if deltas:
                self.packed_deltas[new] = list(deltas)
                self.fused.add(full)
            return data.to(device)
        try:
            w = dequant.dequantize(quant, parts, self.dtype, shape, device)
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{self.info.path}: {key} ({quant.describe()}) cannot be dequantized: {e}") from None
        if not is_finite(w):
            raise CheckpointError(f"{self.info.path}: {key} ({quant.describe()}) holds NaN or infinite values (its "
                                  "scales); the file is damaged: download it again")
        if rows is not None:
            w = w[rows]
        if not deltas:
            return w
        w = self._fused(w.float(), full, rows, device).to(self.dtype)
        self._finite.add(f"{key} (with its LoRAs)", w)
        return w

    def _tensor(self, f, names: set, key: str, full: str, device: torch.device, rows: slice | None = None,
                new: str | None = None) -> torch.Tensor:
        quant = self.info.quant.get(full)
        if quant is not None and quant.format in ROW_FORMATS:
            return self._quantized(f, key, full, quant, device, rows, new)
        t = (f.get_tensor(key) if rows is None else f.get_slice(key)[rows.start:rows.stop]).to(device)
        stem = key[: -len(".weight")] if key.endswith(".weight") else None
        if not (t.is_floating_point() or t.dtype in _FP8):
            raise CheckpointError(f"{key} is stored as {t.dtype}; ltx_mgpu loads bf16/fp16/fp32 or fp8 weights")
        self._finite.add(key, t)
        deltas = self.loras.get(full, ())
        scale = None
        if t.dtype in _FP8 and stem is not None:
            sk = next((s for s in (f"{stem}.weight_scale", f"{stem}.scale_weight") if s in names), None)
            scale = f.get_tensor(sk).to(device=device, dtype=torch.float32) if sk else None
            if scale is not None:
                self._finite.add(sk, scale)
            whole = f.get_slice(key).get_shape()[0] if t.ndim else 1
            if scale is not None and scale.numel() not in (1, whole):
                raise CheckpointError(f"{key}: a {tuple(scale.shape)} fp8 scale fits neither per-tensor nor "
                                      "per-row scaling; use a bf16 file or one with per-tensor or per-row scales")
            if scale is not None and rows is not None and scale.numel() > 1:
                scale = scale.reshape(-1)[rows]
        if t.dtype == torch.float8_e4m3fn and not deltas and new in self.keep_e4m3:
            self.scales[new] = scale
            return t.clone() if t.device.type == "cpu" else t
        if scale is None and not deltas:
            out = t.to(self.dtype)
            if self.dtype == torch.float16 and t.dtype not in (torch.float16, *_FP8):  # may overflow its range
                self._finite.add(f"{key} (cast to float16)", out)
            # safetensors hands out CPU tensors over arbitrarily aligned buffers; a fresh allocation
            # keeps kernels (and so results) independent of the file's byte layout.
            return out.clone() if out.data_ptr() == t.data_ptr() else out
        w = t.float()
        if scale is not None:
            if scale.numel() not in (1, w.shape[0]) and w.numel():
                raise CheckpointError(f"{key}: a {tuple(scale.shape)} fp8 scale fits neither per-tensor nor "
                                      "per-row scaling")
            w = w * (scale.reshape(-1, *([1] * (w.ndim - 1))) if scale.numel() > 1 else scale.reshape(()))
        w = self._fused(w, full, rows, device).to(self.dtype)
        self._finite.add(f"{key} ({'upcast by its scale' if scale is not None else 'with its LoRAs'}, in "
                         f"{str(self.dtype).removeprefix('torch.')})", w)
        return w

    def _fused(self, w: torch.Tensor, full: str, rows: slice | None, device: torch.device) -> torch.Tensor:
        """The float32 weight ``w`` (``rows`` of the whole, for a shard) plus the LoRA deltas of the
        prefix-less key ``full``, ``strength * up @ down`` each in float32 (module doc).

        Raises:
            CheckpointError: a delta of another size than the weight.
        """
        for a, b, s in self.loras.get(full, ()):
            up = b.to(device) if rows is None else b.to(device)[rows]
            delta = torch.mm(up.float(), a.to(device).float())
            if delta.numel() != w.numel():
                raise CheckpointError(f"a LoRA for {full} has shape {tuple(delta.shape)}, the weight {tuple(w.shape)}")
            w = w + s * delta.reshape(w.shape)
            self.fused.add(full)
        return w
