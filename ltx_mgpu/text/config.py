"""What to encode prompts with, once: :class:`TextEncoderConfig`, the one config of a text encoder.

The same frozen value describes an in-process encoder (:class:`ltx_mgpu.text.encoder.local.LocalTextEncoder`),
a text encoder resident in the pool (the ``load_text_encoder`` request is its :meth:`to_params`;
the pool rebuilds it with :meth:`from_params`) and the ComfyUI node's choice. Its checks run
once, when it is built, with the same messages on every side. What it implies that only the
files can say (the weights actually loaded, the cache key) is :mod:`ltx_mgpu.text.cache.keys`'.

A leaf module (no torch), so ComfyUI's node definitions import it cheaply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from ltx_mgpu.choices import AUTO_DTYPE, DTYPE_NAMES, PLACEMENTS, TEXT_DTYPES, WEIGHTS, check_choice

__all__ = ["TOKEN_BUDGET", "DTYPE_ALIASES", "COMPILE_NF4", "COMPILE_ACCELERATE", "MAX_KEY", "TextEncoderConfig",
           "canonical_dtype", "resolve_text_dtype"]

#: Gemma token budget per prompt (LTX-2's ``max_length``): prompts are left-padded to 1024
#: tokens, BOS included. Source: ltx-core ``LTXVGemmaTokenizer`` as used by ModelLedger
#: (max_length=1024) and ComfyUI's connector register padding to ``max(1024, T)``.
TOKEN_BUDGET = 1024
#: The dtype names accepted for Gemma's compute dtype -> torch's name (``ltx_mgpu.choices.TEXT_DTYPES``).
DTYPE_ALIASES = {**{name: name for name in TEXT_DTYPES}, **DTYPE_NAMES}
COMPILE_NF4 = ("compile works with bf16 weights: NF4 (weights nf4, or an NF4 artifact directory, which is always "
               "NF4) dequantizes each layer outside the compiled graphs; turn compile off, or use a bf16 Gemma source "
               "with weights bf16")
COMPILE_ACCELERATE = ("compile runs with placement 'single' or 'batch_parallel': accelerate's hooks move tensors "
                      "between GPUs inside the layers that would be compiled")
#: The longest pool key a ``load_text_encoder`` request may carry (characters).
MAX_KEY = 256


def canonical_dtype(name: Any, auto: bool = False) -> str:
    """A compute dtype name (or ``torch.dtype``) -> torch's name (``"bfloat16"``, ``"float32"``...);
    with ``auto``, :data:`~ltx_mgpu.choices.AUTO_DTYPE` is taken too (and kept).

    Raises:
        ValueError: an unknown name (the message lists the accepted ones).
    """
    text = str(name).removeprefix("torch.").lower() if name is not None else ""
    if auto and text == AUTO_DTYPE:
        return AUTO_DTYPE
    if text not in DTYPE_ALIASES:
        accepted = sorted(DTYPE_ALIASES) + ([AUTO_DTYPE] if auto else [])
        raise ValueError(f"unknown dtype {name!r}; use one of {accepted}")
    return DTYPE_ALIASES[text]


def resolve_text_dtype(device_type: str, weights_mode: str) -> str:
    """What compute dtype ``auto`` means for Gemma on a device of ``device_type`` (``"cpu"``,
    ``"cuda"``...) with weights ``weights_mode`` (``"bf16"`` / ``"nf4"``, as loaded): torch's name.

    * NF4 weights: ``"bfloat16"``, the one dtype they compute in (fp16 gives empty outputs for
      Gemma 3, bitsandbytes #1572).
    * The CPU: ``"float32"``, what ComfyUI's own text encoder computes LTX-2's Gemma in there:
      ComfyUI 0.20.1 runs it with float32 activations (``comfy/sd1_clip.py``
      ``SDClipModel.forward`` passes ``dtype=torch.float32``; ``comfy.ops.manual_cast`` casts each
      weight to its input's dtype; ``comfy/sd.py`` ``CLIP.__init__`` sets the compute dtype to
      float32), its weights held in the file's dtype (``comfy/text_encoders/lt.py`` ``ltxav_te``).
      The CPU has no faster dtype: bf16 there only rounds.
    * A GPU: ``"bfloat16"``, the GPU's fast dtype. ComfyUI computes float32 activations there too
      (the same code), from weights kept in the file's dtype; the pool holds Gemma's weights in the
      compute dtype, so float32 would double Gemma's memory (about 48 GB for 12B) and run its
      GEMMs off the bf16 tensor cores. ``fp32`` on the Gemma Loader gives ComfyUI's result there.
    """
    if weights_mode == "nf4":
        return "bfloat16"
    return "float32" if device_type == "cpu" else "bfloat16"


def _flag(value: Any, name: str, spelling: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be {spelling}, got {value!r}")
    return value


@dataclass(frozen=True)
class TextEncoderConfig:
    """A text encoder: the Gemma source, the projection source, and every setting of it.

    Attributes:
        gemma: a Gemma 3 HF snapshot directory, ComfyUI single file, or NF4 artifact directory
            (made absolute: the pool's working directory is not the caller's).
        projection: an LTX-2 checkpoint or projection file (``text_embedding_projection.*``; absolute).
        weights: one of :data:`ltx_mgpu.choices.WEIGHTS`: what to make of a bf16 source. An NF4
            artifact is always loaded as NF4 (``ltx_mgpu.text.cache.keys.weights_mode``).
        placement: one of :data:`ltx_mgpu.choices.PLACEMENTS` (in the pool; in-process encoding
            runs on one device whatever it says).
        dtype: Gemma's compute dtype by torch's name (``"bfloat16"``; ``"float32"`` for
            reference runs; aliases as :data:`DTYPE_ALIASES`), or ``"auto"``: the device's
            (:func:`resolve_text_dtype`), resolved by :meth:`on_device` where the device is known
            (the client from its pool's spec, the pool from its ranks, an in-process encoder from
            its device) before any cache key or load is made of it.
        token_budget: tokens per prompt (:data:`TOKEN_BUDGET`).
        truncate: cut prompts over the budget (with a warning) instead of failing.
        compile: run Gemma's decoder layers through ``torch.compile`` (bf16 weights; placements
            ``single`` and ``batch_parallel``). Results differ from eager ones at bf16 rounding
            only, like a change of batch size, so the cache key leaves it out.
        max_memory: placement ``accelerate`` only: bytes (or ``"70GiB"``) per pool GPU index.

    Raises (at construction):
        ValueError: an unknown weights mode, placement or dtype; a non-boolean ``truncate`` or
            ``compile``; a token budget that is not a positive int; ``compile`` with NF4 weights
            or placement ``accelerate``; ``max_memory`` without placement ``accelerate``, or not
            an object of device index -> size.
    """

    gemma: str
    projection: str
    weights: str = "bf16"
    placement: str = "single"
    dtype: str = "bfloat16"
    token_budget: int = TOKEN_BUDGET
    truncate: bool = True
    compile: bool = False
    max_memory: Mapping[int, int | str] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "gemma", os.path.abspath(os.fspath(self.gemma)))
        object.__setattr__(self, "projection", os.path.abspath(os.fspath(self.projection)))
        check_choice(self.weights, WEIGHTS, "weights")
        check_choice(self.placement, PLACEMENTS, "placement")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, auto=True))
        budget = self.token_budget
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"token_budget must be a positive int (tokens), got {budget!r}")
        _flag(self.truncate, "truncate", "true or false")
        _flag(self.compile, "compile", "True or False")
        if self.compile and self.weights == "nf4":
            raise ValueError(COMPILE_NF4)
        if self.compile and self.placement == "accelerate":
            raise ValueError(COMPILE_ACCELERATE)
        if self.max_memory is not None:
            if self.placement != "accelerate":
                raise ValueError(f"max_memory applies to placement 'accelerate' only, not {self.placement!r}")
            if not isinstance(self.max_memory, Mapping):
                raise ValueError("max_memory must be an object {device index: bytes or '70GiB'}, got "
                                 f"{type(self.max_memory).__name__}")
            memory = {}
            for k, v in self.max_memory.items():
                if isinstance(k, bool) or not (isinstance(k, int) or (isinstance(k, str) and k.isdigit())):
                    raise ValueError(f"max_memory keys must be device indices like '0', got {k!r}")
                memory[int(k)] = v
            object.__setattr__(self, "max_memory", memory)

    def on_device(self, device_type: str, weights_mode: str) -> TextEncoderConfig:
        """This config with a ``dtype`` of ``auto`` resolved for Gemma on ``device_type`` with
        ``weights_mode`` weights (:func:`resolve_text_dtype`); itself when the dtype is named."""
        if self.dtype != AUTO_DTYPE:
            return self
        return replace(self, dtype=resolve_text_dtype(device_type, weights_mode))

    # ---- the wire form (the ``load_text_encoder`` request's params)

    def to_params(self, key: str | None = None) -> dict:
        """The ``load_text_encoder`` request parameters (``key``: the pool's name for it)."""
        params = {"source": self.gemma, "projection": self.projection, "weights": self.weights,
                  "placement": self.placement, "dtype": self.dtype, "token_budget": self.token_budget,
                  "truncate": self.truncate, "key": key}
        if self.compile:  # only when on: a pool of a release without the field still takes the others
            params["compile"] = True
        if self.max_memory is not None:
            params["max_memory"] = {str(k): v for k, v in self.max_memory.items()}
        return params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> tuple[TextEncoderConfig, str | None]:
        """The config and key of a ``load_text_encoder`` request (the pool's side of :meth:`to_params`).

        Raises:
            ValueError: unknown fields, a missing or relative path, a bad key, or any check of
                the constructor.
        """
        known = {"source", "projection", "key", *(f.name for f in fields(cls))} - {"gemma"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"load_text_encoder has unknown field(s) {unknown}; known: {sorted(known)}")
        paths = {}
        for name, what in (("source", "a Gemma 3 HF snapshot directory, ComfyUI single file or NF4 artifact"),
                           ("projection", "an LTX-2 checkpoint or text projection file")):
            value = params.get(name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"load_text_encoder.{name} is required: {what}")
            if not os.path.isabs(value):
                raise ValueError(f"load_text_encoder.{name} must be an absolute path (the pool's working directory "
                                 f"is not yours), got {value!r}")
            paths[name] = value
        key = params.get("key")
        if key is not None and (not isinstance(key, str) or not 0 < len(key) <= MAX_KEY):
            raise ValueError(f"key must be a string of 1..{MAX_KEY} characters, got {key!r:.80}")
        try:
            dtype = canonical_dtype(params.get("dtype", "bfloat16"), auto=True)
        except ValueError as e:
            raise ValueError(f"load_text_encoder.dtype: {e}") from None
        settings = {f.name: params[f.name] for f in fields(cls) if f.name in params and f.name not in ("dtype",)}
        config = cls(**{**settings, "gemma": paths["source"], "projection": paths["projection"], "dtype": dtype})
        return config, key
