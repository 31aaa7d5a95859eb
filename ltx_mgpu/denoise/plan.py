"""How one LTX-2 transformer is loaded and run: :class:`TransformerPlan`, one frozen value per load.

The plan says which checkpoint, in which dtype, with which LoRAs, how its weights are held
across the pool (``replicated`` / ``sharded``) and in what storage, how its block linears compute
(:attr:`TransformerPlan.linears`), how a model call is split over the ranks (``layout``) and the
largest call it takes (``max_tokens``). It is built and validated once where a request is parsed
(the Model Loader node, ``generate``, the pool's ``load_transformer``: :meth:`TransformerPlan.from_params`)
and handed down as it is: to the loader (:func:`ltx_mgpu.denoise.model.load_ltx_model`), the
sequence-parallel wrapper (its layout and token budget) and the fp8 layers (:attr:`TransformerPlan.fp8`).
Nothing below re-checks it. The pool reports it once, in the load's result and in its status
(:meth:`TransformerPlan.describe`).

The same pattern as the text side's :class:`ltx_mgpu.text.config.TextEncoderConfig`. A leaf
module without torch, so the ComfyUI nodes build plans cheaply: dtypes are torch's names
(``"bfloat16"``), turned into ``torch.dtype`` where the weights are made.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ltx_mgpu.choices import (
    ATTENTION_TYPES,
    FP8_COMPUTES,
    FP8_SCALINGS,
    SP_LAYOUTS,
    TRANSFORMER_COMPILE,
    TRANSFORMER_COMPUTE_DTYPES,
    TRANSFORMER_DTYPES,
    TRANSFORMER_STORAGE,
    TRANSFORMER_WEIGHTS,
    check_choice,
)

__all__ = ["DEFAULT_MAX_TOKENS", "LORA_STRENGTH", "Fp8Config", "LoraSpec", "TransformerPlan"]

#: The video-token budget of a plan that names none (a call of 121 frames at 1280 x 704 has 14,080).
DEFAULT_MAX_TOKENS = 32768
#: A LoRA's strength range (ComfyUI's ``LoraLoader``: -100..100).
LORA_STRENGTH = (-100.0, 100.0)


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """A LoRA file (ComfyUI key naming) and its strength (0: not applied)."""

    path: str
    strength: float = 1.0


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """How the transformer's ``Float8Linear`` layers compute (:mod:`ltx_mgpu.denoise.fp8`).

    Attributes:
        compute: ``"upcast"`` (fp8 storage, GEMMs in the compute dtype) or ``"fp8"`` (e4m3 GEMMs).
        scaling: ``"row"`` (a scale per token and per output channel) or ``"tensor"`` (one each);
            ``"fp8"`` only.
        bias_epilogue: add the bias in the GEMM's epilogue (``"fp8"`` only).
        fast_accum: cuBLASLt's fast FP8 accumulation (``use_fast_accum``: partial sums kept in
            the tensor core's accumulator precision between promotions; ``"fp8"`` only).

    Raises (at construction):
        ValueError: a compute or scaling that is not one of :data:`ltx_mgpu.choices.FP8_COMPUTES`
            / :data:`~ltx_mgpu.choices.FP8_SCALINGS`.
    """

    compute: str = "upcast"
    scaling: str = "row"
    bias_epilogue: bool = True
    fast_accum: bool = True

    def __post_init__(self) -> None:
        check_choice(self.compute, FP8_COMPUTES, "fp8 compute")
        check_choice(self.scaling, FP8_SCALINGS, "fp8 scaling")


def _loras(raw: Any) -> tuple[LoraSpec, ...]:
    """``raw`` (LoraSpecs, ``(path, strength)`` pairs or ``{"path", "strength"}`` objects) as LoraSpecs.

    Raises:
        ValueError: an item of another form or fields, a path that is not a string, a strength
            that is not a finite number in :data:`LORA_STRENGTH` (the message names ``loras[i]``).
    """
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise ValueError(f"loras must be a list of LoRAs, got {type(raw).__name__}")
    specs = []
    for i, item in enumerate(raw):
        if isinstance(item, LoraSpec):
            path, strength = item.path, item.strength
        elif isinstance(item, Mapping):
            unknown = sorted(set(item) - {"path", "strength"})
            if unknown:
                raise ValueError(f"loras[{i}] has unknown field(s) {unknown}; known: ['path', 'strength']")
            path, strength = item.get("path"), item.get("strength", 1.0)
        elif isinstance(item, Sequence) and not isinstance(item, (str, bytes)) and len(item) == 2:
            path, strength = item
        else:
            raise ValueError(f"loras[{i}] must be {{\"path\": str, \"strength\": number}}, got {item!r:.120}")
        if isinstance(path, os.PathLike):
            path = os.fspath(path)
        if not isinstance(path, str) or not path:
            raise ValueError(f"loras[{i}].path must be a file path, got {path!r:.120}")
        low, high = LORA_STRENGTH
        if isinstance(strength, bool) or not isinstance(strength, (int, float)):
            raise ValueError(f"loras[{i}].strength must be a number, got {strength!r:.40}")
        if not (math.isfinite(strength) and low <= strength <= high):
            raise ValueError(f"loras[{i}].strength must be in {low:g}..{high:g} (ComfyUI's LoRA strength range), "
                             f"got {strength!r:.40}")
        specs.append(LoraSpec(os.path.abspath(path), float(strength)))
    return tuple(specs)


@dataclasses.dataclass(frozen=True)
class TransformerPlan:
    """One load of an LTX-2 transformer and how it runs (module doc).

    Attributes:
        checkpoint: the monolith or transformer-only ``.safetensors`` (made absolute: the pool's
            working directory is not the caller's).
        dtype: one of :data:`ltx_mgpu.choices.TRANSFORMER_DTYPES`: the compute dtype, or ``fp8``
            (the blocks' large linears as e4m3 GEMMs, everything else bf16).
        weights: one of :data:`ltx_mgpu.choices.TRANSFORMER_WEIGHTS`: a whole copy per rank, or a
            1/N shard per rank gathered block by block (FSDP2).
        layout: one of :data:`ltx_mgpu.choices.SP_LAYOUTS`: how a model call's batch and tokens are
            split over the ranks (:func:`ltx_mgpu.denoise.parallel.layout.call_layout` decides per call).
        loras: the LoRAs merged at load (``(path, strength)`` pairs are taken too; paths made absolute).
        max_tokens: the largest video token count one call may have, and the largest audio token count
            (reference audio included) (bounds activation memory).
        attention_type: ltx-core's attention backend (one of :data:`ltx_mgpu.choices.ATTENTION_TYPES`),
            or None for the checkpoint's own.
        connectors: a file holding the text connectors to use instead of the checkpoint's (made
            absolute): for a transformer file without them, as the LTX-2.0 GGUF transformers ship
            (ComfyUI's ``ltx-2-19b-embeddings_connector_*.safetensors``, or the full checkpoint);
            None: the checkpoint's own.
        compile: one of :data:`ltx_mgpu.choices.TRANSFORMER_COMPILE`: whether the blocks run
            under ``torch.compile`` (:attr:`compiled`).
        storage: how the checkpoint stores its block linears, one of
            :data:`ltx_mgpu.choices.TRANSFORMER_STORAGE` (``dense``; ``e4m3``: an fp8 file;
            ``ggml``: a GGUF file; ``comfy_quant``: ComfyUI's nvfp4 / int8 layers), or None until
            its header is read (:meth:`with_storage`; the loader resolves it).

    Raises (at construction):
        ValueError: any field outside its choices or range (the message names the field and
            what it takes); a dtype or compile the storage does not take (:meth:`with_storage`).
    """

    checkpoint: str
    dtype: str = "bf16"
    weights: str = "replicated"
    layout: str = "auto"
    loras: tuple[LoraSpec, ...] = ()
    max_tokens: int = DEFAULT_MAX_TOKENS
    attention_type: str | None = None
    connectors: str | None = None
    compile: str = "auto"
    storage: str | None = None

    def __post_init__(self) -> None:
        for name in ("checkpoint", "connectors") if self.connectors is not None else ("checkpoint",):
            raw = getattr(self, name)
            path = os.fspath(raw) if isinstance(raw, os.PathLike) else raw
            if not isinstance(path, str) or not path:
                raise ValueError(f"{name} must be a file path, got {raw!r:.120}")
            object.__setattr__(self, name, os.path.abspath(path))
        check_choice(self.dtype, TRANSFORMER_DTYPES, "dtype")
        check_choice(self.weights, TRANSFORMER_WEIGHTS, "weights")
        check_choice(self.layout, SP_LAYOUTS, "layout")
        check_choice(self.compile, TRANSFORMER_COMPILE, "compile")
        if self.storage is not None:
            check_choice(self.storage, TRANSFORMER_STORAGE, "storage")
            _check_storage(self)
        if self.attention_type is not None:
            check_choice(self.attention_type, ATTENTION_TYPES, "attention_type")
        budget = self.max_tokens
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"max_tokens must be a positive number of video tokens, got {budget!r:.40}")
        object.__setattr__(self, "loras", _loras(self.loras))

    # ---- what follows from the choices

    @property
    def compute_dtype(self) -> str:
        """torch's name of the dtype every weight but the e4m3 ones is held and computed in."""
        return TRANSFORMER_COMPUTE_DTYPES[self.dtype]

    @property
    def linears(self) -> str:
        """How the blocks' large linears run: ``fp8`` (dtype fp8: e4m3 GEMMs), ``packed`` (a GGUF
        file's GGML blocks or ComfyUI's nvfp4 / int8 layers kept on the GPU, and in the shards, as
        stored, dequantized per call), ``upcast`` (a sharded fp8 file: e4m3 as stored, gathered at
        one byte, upcast per call; a replicated one is upcast at load) or ``dense``."""
        if self.dtype == "fp8":
            return "fp8"
        if self.storage in ("ggml", "comfy_quant"):
            return "packed"
        return "upcast" if self.weights == "sharded" and self.storage == "e4m3" else "dense"

    @property
    def compiled(self) -> bool:
        """Whether the blocks run under ``torch.compile``: always for ``linears`` ``fp8``, for
        every dtype with ``compile`` ``on``."""
        return self.linears == "fp8" or self.compile == "on"

    @property
    def fp8(self) -> Fp8Config | None:
        """The fp8 layers' config for :attr:`linears` (None unless ``fp8`` or ``upcast``)."""
        return Fp8Config(self.linears) if self.linears in ("fp8", "upcast") else None

    def with_storage(self, storage: str) -> TransformerPlan:
        """This plan for a checkpoint that stores its block linears as ``storage`` (one of
        :data:`ltx_mgpu.choices.TRANSFORMER_STORAGE`, read from its header).

        Raises:
            ValueError: dtype fp8 for a GGUF file or a file of ComfyUI's nvfp4 / int8 layers (their
                blocks are dequantized per call; e4m3 GEMMs would re-quantize them); compile ``on``
                for such a file (its blocks' dequantizing kernels run eagerly).
        """
        return dataclasses.replace(self, storage=storage)  # __post_init__ checks dtype / compile against it

    def describe(self) -> dict:
        """The plan as the pool reports it (the load's result and its status): every choice and
        what follows from it."""
        return {"dtype": self.dtype, "compute_dtype": self.compute_dtype, "linears": self.linears,
                "weights": self.weights, "storage": self.storage, "layout": self.layout,
                "max_tokens": self.max_tokens, "attention_type": self.attention_type, "connectors": self.connectors,
                "compile": self.compile, "compiled": self.compiled}

    # ---- the wire form (the ``load_transformer`` request's params)

    def to_params(self) -> dict:
        """The ``load_transformer`` request parameters (``storage`` is the pool's to find out)."""
        params: dict[str, Any] = {"checkpoint": self.checkpoint, "dtype": self.dtype, "weights": self.weights,
                                  "layout": self.layout, "max_tokens": self.max_tokens,
                                  "loras": [{"path": s.path, "strength": s.strength} for s in self.loras]}
        if self.attention_type is not None:
            params["attention_type"] = self.attention_type
        if self.connectors is not None:
            params["connectors"] = self.connectors
        if self.compile != "auto":
            params["compile"] = self.compile
        return params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> TransformerPlan:
        """The plan of a ``load_transformer`` request (the pool's side of :meth:`to_params`;
        fields it does not name take their defaults, ``name`` is the pool's business).

        Raises:
            ValueError: unknown fields, a relative checkpoint path, or any check of the constructor.
        """
        known = {f.name for f in dataclasses.fields(cls)} - {"storage"}
        unknown = sorted(set(params) - known - {"name"})
        if unknown:
            raise ValueError(f"load_transformer has unknown field(s) {unknown}; known: {sorted(known | {'name'})}")
        for name in ("checkpoint", "connectors") if "connectors" in params else ("checkpoint",):
            path = params.get(name)
            if not isinstance(path, str) or not os.path.isabs(path):
                raise ValueError(f"load_transformer.{name} must be an absolute path (the pool's working directory is "
                                 f"not yours), got {path!r:.120}")
        return cls(**{k: v for k, v in params.items() if k in known})


def _check_storage(plan: TransformerPlan) -> None:
    """Raise ``ValueError`` naming the fix when ``plan``'s dtype or compile does not fit a checkpoint
    whose blocks stay packed (GGUF, ComfyUI's nvfp4 / int8: dequantized per call): dtype fp8 (e4m3
    GEMMs would re-quantize them) or compile ``on`` (their dequantizing Triton kernels are not
    traced by ``torch.compile``)."""
    if plan.storage not in ("ggml", "comfy_quant") or (plan.dtype != "fp8" and plan.compile != "on"):
        return
    name = os.path.basename(plan.checkpoint)
    kind = "a GGUF file" if plan.storage == "ggml" else "a file of ComfyUI-quantized (nvfp4 / int8) layers"
    if plan.dtype == "fp8":
        raise ValueError(f"{name} is {kind}: its quantized blocks run with dtype bf16, fp16 or fp32 (dequantized per "
                         "call); choose one of those, or dtype fp8 with a bf16 or fp8 .safetensors checkpoint")
    raise ValueError(f"{name} is {kind}: its quantized blocks run eagerly (dequantized per call); set compile to "
                     "auto, or use a bf16 or fp8 .safetensors checkpoint to compile")
