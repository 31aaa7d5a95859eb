"""LTX-2 feature extractors: Gemma 3 hidden states -> the "unprocessed" LTX-2 conditioning.

LTX-2 conditions on *every* Gemma hidden state (the embedding output plus each decoder
layer's output, ``L = num_hidden_layers + 1`` tensors, 49 for Gemma 3 12B), normalised per
layer and projected by the checkpoint's ``text_embedding_projection``:

* **LTX-2.0** (19B; key ``text_embedding_projection.aggregate_embed.weight``, no bias):
  per prompt and per layer, ``8 * (x - mean) / (max - min + 1e-6)`` with the statistics
  taken over the prompt's valid tokens and all ``D`` channels, then one Linear
  ``D*L -> 3840``. Source: ComfyUI ``comfy/text_encoders/lt.py`` (``single_linear``) and
  ltx-core 1.0.0 ``FeatureExtractorV1`` (``_norm_and_concat_padded_batch``).
* **LTX-2.3** (22B; ``video_aggregate_embed.{weight,bias}`` and
  ``audio_aggregate_embed.{weight,bias}``): per token and per layer RMS normalisation over
  ``D`` (eps 1e-6), flatten, then each projection applied to the input scaled by
  ``sqrt(out_features / D)``, outputs concatenated video ‖ audio (4096 + 2048 = 6144).
  Source: ComfyUI ``lt.py`` (``dual_linear``) and ltx-core 1.0.0 ``FeatureExtractorV2``.

The flattening order is channel-major, ``[T, D, L] -> [T, D*L]`` (feature ``d*L + l``), as
both references stack the hidden states on a new last axis.

The result is ComfyUI's *unprocessed* LTX-2 conditioning: the embeddings connectors (with
their learnable registers) run inside the denoiser, as in ComfyUI since PR #12569.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from safetensors import safe_open
from torch import nn

from ltx_mgpu import settings
from ltx_mgpu.files import safetensors_header
from ltx_mgpu.identity import memoized_digest, tensors_digest

ModelVersion = Literal["2.0", "2.3"]


#: Normalisation epsilons. Source: ComfyUI ``lt.py`` / ltx-core ``feature_extractor.py``.
RANGE_EPS = 1e-6
RMS_EPS = 1e-6

_PREFIX = "text_embedding_projection."
_V20_KEYS = ("aggregate_embed.weight",)
_V23_KEYS = (
    "video_aggregate_embed.weight",
    "video_aggregate_embed.bias",
    "audio_aggregate_embed.weight",
    "audio_aggregate_embed.bias",
)


class ProjectionFormatError(ValueError):
    """A file has no usable LTX-2 text projection (the message says what was expected)."""


@dataclass(frozen=True)
class PromptEmbedding:
    """One prompt's LTX-2 conditioning tensor, as ComfyUI's LTX-2 text encoder emits it.

    Attributes:
        tensor: ``[T_valid, D_out]`` float32 on CPU (the pool holds its own prompts in its
            compute dtype until they reach the client, ``PromptEncoder.encode(out_dtype=)``;
            everything public gets float32). ``T_valid`` counts the prompt's real
            tokens (BOS included, left padding removed); ``D_out`` is 3840 for LTX-2.0
            (Gemma 3 12B) and 6144 (video 4096 ‖ audio 2048) for LTX-2.3.
        version: ``"2.0"`` or ``"2.3"``, the projection layout that produced it.
        dropped_tokens: how many tokens were cut because the prompt exceeded the budget.
    """

    tensor: torch.Tensor
    version: ModelVersion
    dropped_tokens: int = 0

    def __post_init__(self) -> None:
        if self.tensor.ndim != 2:
            raise ValueError(f"PromptEmbedding.tensor must be [T, D], got shape {tuple(self.tensor.shape)}")
        if self.version not in ("2.0", "2.3"):
            raise ValueError(f"PromptEmbedding.version must be '2.0' or '2.3', got {self.version!r}")

    @property
    def num_tokens(self) -> int:
        return int(self.tensor.shape[0])

    def to_conditioning(self, device: torch.device | str | None = None) -> list:
        """ComfyUI CONDITIONING: ``[[tensor[1, T, D] float32, {"pooled_output": None,
        "unprocessed_ltxav_embeds": True}]]``.

        The flag tells ComfyUI's ``LTXAV.extra_conds`` -> ``preprocess_text_embeds`` to run
        the caption projection (2.0) and the embeddings connectors; for 2.3 it is
        mandatory because processed and unprocessed widths are both 6144
        (ComfyUI ``comfy/model_base.py``, ``comfy/ldm/lightricks/av_model.py``).
        """
        t = self.tensor if device is None else self.tensor.to(device)
        return [[t.unsqueeze(0), {"pooled_output": None, "unprocessed_ltxav_embeds": True}]]


def conditioning_from_embeddings(embeddings: Sequence[PromptEmbedding]) -> list:
    """Several prompts as one ComfyUI CONDITIONING list (one entry per prompt)."""
    return [e.to_conditioning()[0] for e in embeddings]


class Projection(nn.Module):
    """The checkpoint's ``text_embedding_projection`` with the version's normalisation.

    Call with the Gemma hidden states (``L`` tensors of ``[B, T, D]``) and the attention
    mask ``[B, T]`` (1 = real token); returns ``[B, T, D_out]`` with pad rows zeroed.

    Attributes:
        version: ``"2.0"`` (one ``aggregate_embed``) or ``"2.3"`` (video/audio).
        embedding_dim: Gemma hidden size ``D`` (3840 for Gemma 3 12B).
        num_layers: number of hidden states ``L`` (49 for Gemma 3 12B).
        identity: content digest of the projection tensors (part of cache keys).
        source: the file it was read from.
    """

    def __init__(
        self,
        version: ModelVersion,
        embedding_dim: int,
        num_layers: int,
        weights: dict[str, torch.Tensor],
        identity: str = "",
        source: str = "",
    ) -> None:
        super().__init__()
        self.version = version
        self.embedding_dim = embedding_dim
        self.num_layers = num_layers
        self.identity = identity
        self.source = source
        names = ("aggregate_embed",) if version == "2.0" else ("video_aggregate_embed", "audio_aggregate_embed")
        for name in names:
            weight = weights[f"{name}.weight"]
            if weight.shape[1] != embedding_dim * num_layers:
                raise ProjectionFormatError(
                    f"{name}.weight has {weight.shape[1]} input features, expected "
                    f"{embedding_dim} x {num_layers} = {embedding_dim * num_layers}"
                )
            # Stored layer-major: feature l*D + d instead of the checkpoint's d*L + l, so the
            # normalised layers are written into one buffer with contiguous copies (the
            # same products, summed in another order).
            lin = _frozen_linear(self.from_file_layout(weight), weights.get(f"{name}.bias"))
            setattr(self, name, lin)

    def from_file_layout(self, weight: torch.Tensor) -> torch.Tensor:
        """A projection weight ``[out, D*L]`` of the checkpoint's feature order (``d*L + l``) in
        the order this module stores it (``l*D + d``), contiguous; any dtype and device (rows
        are permuted independently, so a block of rows may be given)."""
        return weight.reshape(-1, self.embedding_dim, self.num_layers).transpose(1, 2).reshape(
            weight.shape[0], -1).contiguous()

    def to_file_layout(self, weight: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`from_file_layout`: a stored weight (or block of its rows) in
        the checkpoint's feature order ``d*L + l``, contiguous."""
        return weight.reshape(-1, self.num_layers, self.embedding_dim).transpose(1, 2).reshape(
            weight.shape[0], -1).contiguous()

    @property
    def in_features(self) -> int:
        return self.embedding_dim * self.num_layers

    @property
    def out_features(self) -> int:
        if self.version == "2.0":
            return self.aggregate_embed.out_features
        return self.video_aggregate_embed.out_features + self.audio_aggregate_embed.out_features

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, hidden_states: Sequence[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
        """Normalise and project (:meth:`normalised` then :meth:`project`), pad rows zeroed.

        Args:
            hidden_states: ``L`` tensors ``[B, T, D]`` (any float dtype; moved to the
                projection's device).
            attention_mask: ``[B, T]``, nonzero for real tokens (left or right padding).

        Returns:
            ``[B, T, D_out]`` in the projection's dtype; padded positions are zero.

        Raises:
            ValueError: wrong number of hidden states or hidden size for this projection.
        """
        mask = attention_mask.to(device=self.device).bool()
        out = self.project(self.normalised(hidden_states, mask))
        return out * mask.unsqueeze(-1).to(out.dtype)

    def normalised(self, hidden_states: Sequence[torch.Tensor], attention_mask: torch.Tensor) -> torch.Tensor:
        """The version's per-layer normalisation, layers concatenated layer-major.

        Statistics are computed in float32 per layer over valid tokens; the result is stored in
        the projection's dtype for the matmul.

        Args:
            hidden_states: ``L`` tensors ``[B, T, D]``.
            attention_mask: ``[B, T]``, nonzero for real tokens.

        Returns:
            ``[B, T, L*D]`` in the projection's dtype on its device (feature ``l*D + d``);
            padded positions are zero.

        Raises:
            ValueError: wrong number of hidden states or hidden size for this projection.
        """
        if len(hidden_states) != self.num_layers:
            raise ValueError(
                f"this LTX-{self.version} projection takes {self.num_layers} hidden states "
                f"(a Gemma with {self.num_layers - 1} layers); got {len(hidden_states)}. "
                "Use the Gemma that matches the checkpoint (Gemma 3 12B for LTX-2)."
            )
        d = hidden_states[0].shape[-1]
        if d != self.embedding_dim:
            raise ValueError(
                f"this LTX-{self.version} projection expects Gemma hidden size {self.embedding_dim}, got {d}"
            )
        mask = attention_mask.to(device=self.device).bool()
        return _features_fn(self.device, self.version)(tuple(hidden_states), mask, self.dtype)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The projection(s) of :meth:`normalised` features: ``[..., L*D] -> [..., D_out]`` in
        the projection's dtype (2.3: each projection scaled by ``sqrt(out / D)``, video ‖ audio).
        Rows are independent, so any slice of a batch may be projected on its own."""
        lead = features.shape[:-1]
        flat = features.reshape(-1, features.shape[-1])
        if self.version == "2.0":
            out = torch.nn.functional.linear(flat, self.aggregate_embed.weight)
        else:
            outs = []
            for lin in (self.video_aggregate_embed, self.audio_aggregate_embed):
                scale = math.sqrt(lin.out_features / self.embedding_dim)
                outs.append(torch.addmm(lin.bias, flat, lin.weight.t(), alpha=scale))
            out = torch.cat(outs, dim=-1)
        return out.reshape(*lead, -1)


def _build_features(hidden_states: tuple[torch.Tensor, ...], mask: torch.Tensor, dtype: torch.dtype,
                    version: str) -> torch.Tensor:
    """Normalise each layer in float32 and concatenate layer-major: ``[B, T, L*D]`` in ``dtype``."""
    normalise = _range_normalise if version == "2.0" else _rms_normalise
    device = mask.device
    return torch.cat([normalise(h.to(device=device, dtype=torch.float32), mask).to(dtype) for h in hidden_states],
                     dim=-1)


@functools.cache
def _features_fn(device: torch.device, version: str):
    """The feature builder for a device: on CUDA compiled once with ``torch.compile`` (dynamic
    shapes), which fuses each layer's upcast, statistics, normalisation and downcast into the
    write of the concatenated buffer (eager, these memory-bound elementwise passes over every
    layer's hidden states rival the 188160-wide projection GEMM). On other devices, or when
    ``LTX_MGPU_NO_COMPILE=1``, the eager function."""
    fn = functools.partial(_build_features, version=version)
    if device.type == "cuda" and not settings.NO_COMPILE.get():
        return torch.compile(fn, dynamic=True)
    return fn


def _frozen_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias, requires_grad=False)
    return lin


def _range_normalise(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """LTX-2.0, one layer: ``8 (x - mean) / (max - min + 1e-6)`` per sample over its valid
    tokens and all channels.

    ``x``: ``[B, T, D]`` float32; ``mask``: ``[B, T]`` bool. Pad rows come out zero.
    """
    m = mask.unsqueeze(-1)
    count = mask.sum(dim=1).to(x.dtype)[:, None, None] * x.shape[-1]
    mean = torch.where(m, x, 0.0).sum(dim=(1, 2), keepdim=True) / count
    x_min = torch.where(m, x, math.inf).amin(dim=(1, 2), keepdim=True)
    x_max = torch.where(m, x, -math.inf).amax(dim=(1, 2), keepdim=True)
    normed = (x - mean) * (8.0 / (x_max - x_min + RANGE_EPS))
    return torch.where(m, normed, 0.0)


def _rms_normalise(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """LTX-2.3, one layer: per token ``x * rsqrt(mean_D(x^2) + 1e-6)``; pad rows zero."""
    normed = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + RMS_EPS)
    return torch.where(mask.unsqueeze(-1), normed, 0.0)


def detect_projection_version(keys: Sequence[str]) -> tuple[ModelVersion, str]:
    """Find the projection layout among a file's tensor names.

    Returns ``(version, prefix)`` where prefix is ``"text_embedding_projection."`` or ``""``
    (standalone projection files may store the bare names).

    Raises:
        ProjectionFormatError: neither layout is present.
    """
    keyset = set(keys)
    for prefix in (_PREFIX, ""):
        if all(prefix + k in keyset for k in _V23_KEYS):
            return "2.3", prefix
        if all(prefix + k in keyset for k in _V20_KEYS):
            return "2.0", prefix
    raise ProjectionFormatError(
        "no LTX-2 text projection found. Expected an LTX-2 checkpoint or projection file with "
        "'text_embedding_projection.aggregate_embed.weight' (LTX-2.0) or "
        "'text_embedding_projection.{video,audio}_aggregate_embed.{weight,bias}' (LTX-2.3)"
    )


#: Gemma 3 text towers whose hidden states an LTX-2 projection may take, by the projection's input
#: width ``hidden states x width``: the one LTX-2 is made for, and the embedded defaults' Gemmas
#: (``ltx_mgpu.assets``).
_GEMMAS_BY_WIDTH = {49 * 3840: ("Gemma 3 12B", 49, 3840),
                    19 * 640: ("the Gemma 3 270M (the embedded default)", 19, 640),
                    7 * 64: ("the embedded tiny Gemma 3", 7, 64)}


def projection_gemma(in_features: int) -> str:
    """Which Gemma a projection of input width ``in_features`` was made for, in words: a known
    one by name (``"Gemma 3 12B (49 hidden states of width 3840)"``), else the product it needs."""
    known = _GEMMAS_BY_WIDTH.get(in_features)
    if known is not None:
        name, states, width = known
        return f"{name} ({states} hidden states of width {width})"
    return (f"a Gemma whose hidden states x width make {in_features} (Gemma 3 12B, which LTX-2 is made for, "
            "has 49 x 3840 = 188160)")


def load_projection(
    path: str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
) -> Projection:
    """Load the text projection from an LTX-2 monolith checkpoint or a standalone file.

    Only the projection tensors are read (memory-mapped), never the whole checkpoint.

    Args:
        path: a ``.safetensors`` file holding ``text_embedding_projection.*`` (monolith
            ``models/checkpoints/ltx-2*.safetensors``) or the bare projection names
            (e.g. ComfyUI's ``ltx-2.3_text_projection_bf16.safetensors``).
        device, dtype: where and in which dtype the projection computes.
        num_layers: the number of Gemma hidden states ``L``; inferred from the weight's
            input width when the Gemma hidden size is known to the caller, otherwise
            ``in_features / 3840`` (Gemma 3 12B) is assumed and checked at call time.

    Raises:
        FileNotFoundError: the path does not exist.
        ProjectionFormatError: the file holds no projection, or shapes are inconsistent.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"projection source not found: {path}")
    if not path.endswith(".safetensors"):
        raise ProjectionFormatError(f"{path}: expected a .safetensors LTX-2 checkpoint or projection file")
    version, prefix = detect_projection_version(_header_keys(path))
    names = _V20_KEYS if version == "2.0" else _V23_KEYS
    with safe_open(path, framework="pt", device="cpu") as f:
        raw = {k: f.get_tensor(prefix + k) for k in names}
    identity = memoized_digest(path, "ltx-projection", lambda: tensors_digest(raw, extra=f"ltx-{version}-projection"))
    weights = {k: v.to(device=device, dtype=dtype) for k, v in raw.items()}
    in_features = weights[names[0]].shape[1]
    if num_layers is None:
        embedding_dim = 3840
        if in_features % embedding_dim:
            raise ProjectionFormatError(
                f"{path}: this LTX-{version} projection takes {in_features} input features: it belongs to "
                f"{projection_gemma(in_features)}, not to Gemma 3 12B (width 3840), which is assumed without "
                "num_layers; pass num_layers for another Gemma"
            )
        num_layers = in_features // embedding_dim
    if in_features % num_layers:
        raise ProjectionFormatError(
            f"{path}: this LTX-{version} projection takes {in_features} input features: it belongs to "
            f"{projection_gemma(in_features)}, not to this Gemma with {num_layers} hidden states. Pass the "
            "checkpoint (or projection file) made for this Gemma, or the Gemma this checkpoint was made for")
    if version == "2.3":
        for name in ("video", "audio"):
            w, b = weights[f"{name}_aggregate_embed.weight"], weights[f"{name}_aggregate_embed.bias"]
            if w.shape[1] != in_features or b.shape != (w.shape[0],):
                raise ProjectionFormatError(f"{path}: inconsistent {name}_aggregate_embed shapes "
                                            f"{tuple(w.shape)} / {tuple(b.shape)}")
    return Projection(
        version=version,
        embedding_dim=in_features // num_layers,
        num_layers=num_layers,
        weights=weights,
        identity=identity,
        source=path,
    )


def projection_identity(path: str | os.PathLike) -> str:
    """The content identity of a file's text projection, without building the module
    (memoised by the file's stat signature; the first call reads the projection tensors).

    Raises:
        FileNotFoundError, ProjectionFormatError: as :func:`load_projection`.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"projection source not found: {path}")

    def compute() -> str:
        version, prefix = detect_projection_version(_header_keys(path))
        names = _V20_KEYS if version == "2.0" else _V23_KEYS
        with safe_open(path, framework="pt", device="cpu") as f:
            raw = {k: f.get_tensor(prefix + k) for k in names}
        return tensors_digest(raw, extra=f"ltx-{version}-projection")

    return memoized_digest(path, "ltx-projection", compute)


def _header_keys(path: str) -> list[str]:
    """A projection source's tensor names; a damaged or foreign file is a ProjectionFormatError."""
    return safetensors_header(path, ProjectionFormatError, "; give an LTX-2 checkpoint or projection file")[0]
