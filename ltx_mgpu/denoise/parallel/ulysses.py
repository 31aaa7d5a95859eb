"""Ulysses sequence parallelism for the ltx-core 1.0.0 LTX-2 transformer.

The video tokens are split across the ranks of a process group; everything else is
replicated. Only two attention modules per block need the whole video sequence, and both
are handled by replacing their ``attention_function`` slot (ltx-core 1.0.0 has exactly one:
``attention_function(q, k, v, heads, mask)`` with q/k/v ``[B, T, H*D]``), never by forking
model code:

* ``attn1`` (video self-attention): q/k/v go tokens -> heads with one ``all_to_all_single``
  (``[B, T_local, H, D]`` -> ``[B, T_padded, H/W, D]``), the original attention function runs
  on ``H/W`` heads over the full sequence, and the result goes heads -> tokens.
* ``video_to_audio_attn`` (Q = audio, replicated; K/V = video, sharded): each rank keeps its
  ``Ha/W`` audio query heads, K/V go tokens -> heads, and the head outputs are all-gathered.

RoPE is applied per token from the local positions before the attention function is called,
so exchanging heads afterwards is exact. ``attn2``, ``audio_to_video_attn`` (queries are local
video tokens), the audio modules (audio is replicated), FFNs and AdaLN are per token.

Padding: the video sequence is padded to a multiple of the world size so every rank holds
an equal, non-empty slice (a rank with no tokens would skip the collectives inside the
blocks and hang the others: ltx-core 1.0.0's ``BasicAVTransformerBlock.forward`` in
``ltx_core/model/transformer/transformer.py`` runs nothing for an empty video), or further, to
a token bucket (:mod:`ltx_mgpu.denoise.parallel.buckets`: compiled blocks then run one graph for nearby
sizes; one padding serves both, :meth:`SequenceParallelTransformer.padded_tokens`; with one rank
the wrappers pad without exchanging anything). Padded tokens get a zero latent, the last real
token's timestep and the last real token's positions (so RoPE stays finite); they are appended
at the end of the whole sequence, so after the exchange the real keys are the first ``T`` of
every rank's full sequence. Padded *keys* are left out, not masked: the attention function gets
the real keys and values only (views, no copy) in **both** ``attn1`` and
``video_to_audio_attn``, the model's own mask cut alike, so no mask is added and SDPA keeps its
mask-less flash / cuDNN kernels (and ltx-core's FlashAttention3, which takes no mask, runs
padded calls). The LTX-2 reference masks only ``attn1``, which lets audio attend to padding and
diverge (``tests/integration/test_sequence_parallel_ranks.py``,
``test_audio_diverges_without_the_video_to_audio_padding_mask``). Padded query rows still
attend to the real keys, so their (discarded) outputs stay finite and never poison the real
tokens; every other module is per token (``attn2``, ``audio_to_video_attn``: padded queries
only), and the padded rows are cut from the output. So a padded call equals the unpadded one
up to floating-point reduction order.

The batch over groups of ranks (:mod:`ltx_mgpu.denoise.parallel.layout` decides when, from the
plan's ``layout``; :meth:`SequenceParallelTransformer.layout_for`): group ``i`` of ``W / G``
consecutive ranks runs its samples (and their perturbation configs), Ulysses-parallel over its
own process group (made once per pool group and group count) or, one rank per group, on the
plain model; every rank then all-gathers the groups' outputs. With ``auto`` each rank holds the
same tokens as under pure Ulysses (``B * T / W``) and the all-to-alls run over fewer ranks.

Compiling (dtype fp8 compiles every block, :func:`ltx_mgpu.denoise.fp8.compile_blocks`): the two
wrappers are one opaque operator of the block's graph, ``torch.ops.ltx_mgpu.ulysses_attention``
(``torch.library``; out shaped like the queries), which runs the installed wrapper of its kind
eagerly: the exchanges, the cut to the real keys (whose count varies inside a token bucket) and
the attention function. So a block compiles to one graph, with no graph break (a break makes
Dynamo trace the block's frame twice and cut it into several graphs, each traced, cached and
looked up apart). The wrapper a graph's call runs is the one of the first block, set for the
duration of the model call by :meth:`SequenceParallelTransformer.forward`: every block's wrapper
of a kind holds the same state and inner function (ltx-core builds every ``Attention`` with one,
:func:`~ltx_mgpu.denoise.attention.function.install` sets one).

Every rank must call ``forward`` with the same inputs and perturbation config: the blocks
skip attention (and so the collectives) on ``all_perturbed`` / skip flags, which is safe
only when every rank skips alike. The collectives move bytes only, so the result equals
world size 1 up to floating-point reduction order. Inference only (no autograd through the
collectives).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from ltx_core.guidance.perturbations import BatchedPerturbationConfig
from ltx_core.model.transformer.modality import Modality
from ltx_core.model.transformer.model import LTXModel

from ltx_mgpu.denoise.parallel.buckets import TokenBuckets
from ltx_mgpu.denoise.parallel.layout import CallLayout, call_layout
from ltx_mgpu.denoise.parallel.split import (
    ULYSSES_SPLIT,
    SequenceParallelConfigError,
    check_sequence_parallel_config,
    check_token_budget,
    valid_world_sizes,
)

__all__ = [
    "SequenceParallelConfigError",
    "SequenceParallelTransformer",
    "UlyssesSelfAttention",
    "UlyssesVideoToAudioAttention",
    "check_sequence_parallel_config",
    "check_token_budget",
    "install_attention_wrappers",
    "remove_attention_wrappers",
    "shard_video",
    "valid_world_sizes",
]


# --------------------------------------------------------------------------- collectives


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Exchange the dim-0 chunks of ``x`` (chunk j goes to rank j; chunk i comes from rank i)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _all_gather_stacked(x: torch.Tensor, world: int, group) -> torch.Tensor:
    """``[*shape]`` on every rank -> ``[world, *shape]`` (row r from rank r)."""
    x = x.contiguous()
    # the concatenated form [world * d0, ...] is the one every backend accepts (gloo rejects the stacked one)
    out = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out.view(world, *x.shape)


@dataclasses.dataclass
class _ShardState:
    """What the attention wrappers of one SP model share: the group and this forward's padding.
    ``world`` 1 (no group): padding alone (token buckets), every exchange the identity."""

    group: object
    world: int
    rank: int
    valid_tokens: int = 0
    padded_tokens: int = 0
    mask_v2a_keys: bool = True  # False only to demonstrate the reference flaw in tests

    def real_keys(self, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
        """``(k, v, mask)`` of the whole (padded) video sequence, ``[B, T_padded, ...]`` (mask
        ``[..., T_padded]`` keys last), cut to its real tokens, the first ``valid_tokens``
        (views, no copy): the padded keys are left out of the attention instead of masked, so no
        mask is added and SDPA keeps its mask-less flash / cuDNN kernels. Unchanged without
        padding."""
        n = self.valid_tokens
        if self.padded_tokens == n:
            return k, v, mask
        return k[:, :n], v[:, :n], (mask[..., :n] if mask is not None else None)

    def tokens_to_heads(self, tensors: list[torch.Tensor], heads: int) -> list[torch.Tensor]:
        """n tensors ``[B, T_local, heads*D]`` -> n tensors ``[B, T_padded, (heads/W)*D]``."""
        w = self.world
        if w == 1:
            return list(tensors)
        b, t, hd = tensors[0].shape
        n = len(tensors)
        # one copy into the send layout [W(head group), n, B, T_loc, h, D]
        x = torch.stack([a.reshape(b, t, w, heads // w, hd // heads).permute(2, 0, 1, 3, 4) for a in tensors], 1)
        y = _all_to_all(x, self.group)  # [W(source rank = token block), n, B, T_loc, h, D]
        y = y.permute(1, 2, 0, 3, 4, 5).reshape(n, b, w * t, hd // w)
        return list(y.unbind(0))

    def heads_to_tokens(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """``[B, T_padded, (heads/W)*D]`` -> ``[B, T_local, heads*D]``."""
        w = self.world
        if w == 1:
            return x
        b, t, hd_local = x.shape
        x = x.reshape(b, w, t // w, heads // w, hd_local * w // heads).transpose(0, 1)
        y = _all_to_all(x, self.group)  # [W(source rank = head group), B, T_loc, h, D]
        return y.permute(1, 2, 0, 3, 4).reshape(b, t // w, hd_local * w)


# --------------------------------------------------------------------------- attention wrappers


class UlyssesSelfAttention:
    """``attn1.attention_function`` for SP: all-to-all tokens->heads, attend, heads->tokens.

    ``inner`` is the original ltx-core attention callable. Every query (padded ones too)
    attends to the real keys only (:meth:`_ShardState.real_keys`); the model's own mask (a
    ``(B, 1, T_padded, T_padded)`` bias from ``Modality.attention_mask``, padded by the SP
    model) is cut to the same keys.
    """

    kind = "self"

    def __init__(self, inner, state: _ShardState):
        self.inner = inner
        self.state = state

    def __call__(self, q, k, v, heads: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque call in the graph (module doc: Compiling)
            return torch.ops.ltx_mgpu.ulysses_attention(q, k, v, heads, mask, self.kind)
        return self.run(q, k, v, heads, mask)

    def run(self, q, k, v, heads: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The exchange and the attention, eagerly: ``[B, T_local, heads*D]`` out, like ``q``."""
        s = self.state
        q, k, v = s.tokens_to_heads([q, k, v], heads)
        k, v, mask = s.real_keys(k, v, mask)
        out = self.inner(q, k, v, heads // s.world, mask)
        return s.heads_to_tokens(out, heads)


class UlyssesVideoToAudioAttention:
    """``video_to_audio_attn.attention_function`` for SP (Q audio replicated, K/V video sharded).

    Each rank attends with its ``heads/W`` audio query heads over the real video keys (the
    padded ones left out), then the head outputs are all-gathered: ``[B, T_audio, heads*D]``.
    """

    kind = "video_to_audio"

    def __init__(self, inner, state: _ShardState):
        self.inner = inner
        self.state = state

    def __call__(self, q, k, v, heads: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque call in the graph (module doc: Compiling)
            return torch.ops.ltx_mgpu.ulysses_attention(q, k, v, heads, mask, self.kind)
        return self.run(q, k, v, heads, mask)

    def run(self, q, k, v, heads: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The exchange and the attention, eagerly: ``[B, T_audio, heads*D]`` out, like ``q``."""
        s = self.state
        if mask is not None:
            raise NotImplementedError("sequence parallelism does not support a video->audio attention mask")
        b, t_audio, hd = q.shape
        k, v = s.tokens_to_heads([k, v], heads)
        if s.mask_v2a_keys:
            k, v, _ = s.real_keys(k, v)
        if s.world == 1:
            return self.inner(q, k, v, heads, None)
        h_local = heads // s.world
        q = q.reshape(b, t_audio, s.world, h_local, hd // heads)[:, :, s.rank].reshape(b, t_audio, -1)
        out = self.inner(q, k, v, h_local, None)
        gathered = _all_gather_stacked(out, s.world, s.group)  # [W, B, T_audio, h*D]
        return gathered.view(s.world, b, t_audio, h_local, -1).permute(1, 2, 0, 3, 4).reshape(b, t_audio, hd)


#: The wrappers a compiled graph's ``ulysses_attention`` calls run: the installed ones of the
#: sequence-parallel forward under way, by ``kind`` (:meth:`SequenceParallelTransformer._ulysses`
#: sets it for its model call; forwards never nest).
_ACTIVE: dict[str, UlyssesSelfAttention | UlyssesVideoToAudioAttention] = {}


@torch.library.custom_op("ltx_mgpu::ulysses_attention", mutates_args=())
def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, mask: torch.Tensor | None,
                      kind: str) -> torch.Tensor:
    """A wrapper's :meth:`~UlyssesSelfAttention.run` as one operator of a compiled graph: the
    wrapper of ``kind`` (``"self"`` or ``"video_to_audio"``) installed for the forward under way;
    out: a new contiguous tensor shaped and typed like ``q``.

    Raises:
        RuntimeError: called outside a sequence-parallel forward.
    """
    wrapper = _ACTIVE.get(kind)
    if wrapper is None:
        raise RuntimeError(f"ulysses_attention ({kind}) runs only inside SequenceParallelTransformer.forward")
    return wrapper.run(q, k, v, heads, mask).contiguous()


@ulysses_attention.register_fake
def _(q, k, v, heads, mask, kind):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


#: The wrapper of each attention module :data:`~ltx_mgpu.denoise.parallel.split.ULYSSES_SPLIT` declares,
#: by how its queries are split.
_WRAPPERS = {a.module: {"split": UlyssesSelfAttention, "replicated": UlyssesVideoToAudioAttention}[a.queries]
             for a in ULYSSES_SPLIT.attention}


def install_attention_wrappers(model: LTXModel, state: _ShardState) -> int:
    """Point every block's ``attn1`` / ``video_to_audio_attn`` at SP wrappers; returns the count.

    Idempotent: an existing SP wrapper is replaced by one around the same original function
    (never a wrapper around a wrapper).
    """
    count = 0
    for block in model.transformer_blocks:
        for name, wrapper_cls in _WRAPPERS.items():
            attn = getattr(block, name, None)
            if attn is None:
                continue
            inner = attn.attention_function
            if isinstance(inner, tuple(_WRAPPERS.values())):
                inner = inner.inner
            attn.attention_function = wrapper_cls(inner, state)
            count += 1
    return count


def remove_attention_wrappers(model: LTXModel) -> int:
    """Restore the original attention functions; returns how many wrappers were removed."""
    count = 0
    for block in model.transformer_blocks:
        for name in _WRAPPERS:
            attn = getattr(block, name, None)
            if attn is not None and isinstance(attn.attention_function, tuple(_WRAPPERS.values())):
                attn.attention_function = attn.attention_function.inner
                count += 1
    return count


# --------------------------------------------------------------------------- padding / sharding


def _pad_tokens(x: torch.Tensor, dim: int, pad: int, zeros: bool) -> torch.Tensor:
    """Append ``pad`` entries along ``dim``: zeros, or copies of the last entry."""
    if pad == 0:
        return x
    if zeros:
        shape = list(x.shape)
        shape[dim] = pad
        return torch.cat([x, x.new_zeros(shape)], dim=dim)
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    reps = [1] * x.ndim
    reps[dim] = pad
    return torch.cat([x, last.repeat(reps)], dim=dim)


def shard_video(video: Modality, world: int, rank: int, padded: int | None = None) -> tuple[Modality, int]:
    """Pad the video to ``padded`` tokens (default: the next multiple of ``world``) and return this
    rank's contiguous slice.

    Args:
        video: ltx-core ``Modality``: latent ``[B, T, C]``, timesteps ``[B, T]`` (or ``[B, 1]`` /
            ``[B]``, broadcast, left as is), positions ``[B, 3, T, 2]``, optional attention_mask
            ``[B, T, T]`` in [0, 1].
        padded: the padded count (a token bucket, :meth:`ltx_mgpu.denoise.parallel.buckets.TokenBuckets.padded`):
            a multiple of ``world``, at least ``T``.
    Returns:
        (local modality with ``T_padded / world`` tokens, ``T_padded``). The attention mask, if
        any, is padded to ``[B, T_padded, T_padded]`` (padded keys 0, padded queries see every
        real key) and NOT sliced: after the all-to-all each rank attends with all queries.
    """
    t = video.latent.shape[1]
    t_pad = -(-t // world) * world if padded is None else int(padded)
    if t_pad < t or t_pad % world:
        raise ValueError(f"cannot pad {t} video tokens to {t_pad} over {world} ranks: give a multiple of {world} "
                         f"of at least {t}")
    pad = t_pad - t
    t_loc = t_pad // world
    sl = slice(rank * t_loc, (rank + 1) * t_loc)

    latent = _pad_tokens(video.latent, 1, pad, zeros=True)[:, sl]
    positions = _pad_tokens(video.positions, 2, pad, zeros=False)[:, :, sl]
    timesteps = video.timesteps
    if timesteps.ndim >= 2 and timesteps.shape[1] == t and t > 1:
        timesteps = _pad_tokens(timesteps, 1, pad, zeros=False)[:, sl]
    mask = video.attention_mask
    if mask is not None and pad:
        full = mask.new_zeros(mask.shape[0], t_pad, t_pad)
        full[:, :t, :t] = mask
        full[:, t:, :t] = 1
        mask = full
    local = dataclasses.replace(video, latent=latent, positions=positions, timesteps=timesteps, attention_mask=mask)
    return local, t_pad


# --------------------------------------------------------------------------- the batch over groups


#: The process groups of a pool group split into G groups of consecutive ranks, by (its ranks, G).
_GROUPS: dict[tuple[tuple[int, ...], int], list] = {}


def _group_state(group, world: int, rank: int, groups: int, mask_v2a_keys: bool) -> _ShardState:
    """This rank's group when ``group`` (``world`` ranks) is split into ``groups`` groups of
    consecutive ranks, as a :class:`_ShardState`. ``new_group`` is called for every group on every
    rank, in the same order, as torch.distributed requires (every rank decides the layout from the
    same call, so all of them get here together)."""
    members = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    size = world // groups
    key = (tuple(members), groups)
    if key not in _GROUPS:  # made once per pool group and group count
        backend = dist.get_backend(group)
        _GROUPS[key] = [dist.new_group(members[i * size:(i + 1) * size], backend=backend) for i in range(groups)]
    return _ShardState(_GROUPS[key][rank // size], size, rank % size, mask_v2a_keys=mask_v2a_keys)


def _batch_slice(m: Modality, part: slice, batch: int) -> Modality:
    """``m`` with every per-sample tensor cut to the samples ``part`` (tensors of batch 1 are
    broadcast and kept)."""
    def cut(t):
        return t[part] if isinstance(t, torch.Tensor) and t.ndim and t.shape[0] == batch else t

    return dataclasses.replace(m, latent=cut(m.latent), sigma=cut(m.sigma), timesteps=cut(m.timesteps),
                               positions=cut(m.positions), context=cut(m.context), context_mask=cut(m.context_mask),
                               attention_mask=cut(m.attention_mask))


def _perturbations_slice(perturbations: BatchedPerturbationConfig | None, part: slice):
    """The perturbation configs of the samples ``part`` (None stays None)."""
    return None if perturbations is None else BatchedPerturbationConfig(list(perturbations.perturbations[part]))


# --------------------------------------------------------------------------- the wrapper


class SequenceParallelTransformer(torch.nn.Module):
    """An ltx-core ``LTXModel`` run with Ulysses sequence parallelism over ``group``.

    ``forward(video, audio, perturbations=None) -> (video_velocity, audio_velocity)`` has the
    same contract as ``LTXModel.forward``: velocities ``[B, T_video, C_out]`` and
    ``[B, T_audio, C_audio_out]``, both full-length on every rank. Every rank must pass the
    same inputs (full, unsharded video). Wrap the velocity model, below ``X0Model``.

    Args:
        model: the ltx-core ``LTXModel`` (a full replica on every rank).
        group: the process group to split over (NCCL on GPU, gloo on CPU), or None for the
            default group when torch.distributed is initialised, else world size 1.
        max_tokens: the largest video (and audio) token count accepted (activation-memory bound; a positive
            count: the transformer's plan, ``ltx_mgpu.denoise.plan.TransformerPlan``, checked it).
        buckets: pad every call's video up to its token bucket
            (:class:`~ltx_mgpu.denoise.parallel.buckets.TokenBuckets`, combined with the padding to a
            multiple of the ranks, never above ``max_tokens`` rounded up to it), so compiled
            blocks run one graph for nearby sizes; None (default): only that padding.
    Raises:
        TypeError: ``model`` is not an ``LTXModel`` (e.g. an ``X0Model``: pass its
            ``velocity_model``).
        SequenceParallelConfigError: the world size does not divide the split head counts
            (raised here, before any collective, identically on every rank); in ``forward``,
            before any collective: the video or the audio (reference audio included) has more
            than ``max_tokens`` tokens.
    At world size 1 without ``buckets`` no wrapper is installed and ``forward`` calls the model
    directly; with them the wrappers run with one rank (padding alone: no exchange), as does a
    group of one rank of a split batch.
    ``layout``: ``ulysses`` (default here), ``cfg_ulysses`` or ``auto``: how a call's batch is
    split over groups of ranks (:mod:`ltx_mgpu.denoise.parallel.layout`; one of
    ``ltx_mgpu.choices.SP_LAYOUTS``, as the plan checked it).
    ``_mask_v2a_keys=False`` reproduces the LTX-2 reference's flaw (no padded-key mask in
    video->audio attention); it exists only so a test can show the mask matters.
    """

    def __init__(self, model: LTXModel, group=None, max_tokens: int = 32768, *, layout: str = "ulysses",
                 buckets: TokenBuckets | None = None, _mask_v2a_keys: bool = True):
        super().__init__()
        self.layout = layout
        if not isinstance(model, LTXModel):
            hint = " (an X0Model: pass its .velocity_model)" if hasattr(model, "velocity_model") else ""
            raise TypeError(f"SequenceParallelTransformer wraps an ltx-core LTXModel, got {type(model).__name__}{hint}")
        self.model = model
        self.max_tokens = int(max_tokens)
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.world_size, self.rank = 1, 0
        else:
            self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        check_sequence_parallel_config(model, self.world_size)
        self._state = None
        self._group = group
        self._mask_v2a_keys = _mask_v2a_keys
        self.buckets = buckets
        # one rank alone (world size 1, or a group of one rank of a split batch): padding to a bucket
        self._single = _ShardState(None, 1, 0, mask_v2a_keys=_mask_v2a_keys) if buckets is not None else None
        if self.world_size > 1:
            self._state = _ShardState(group, self.world_size, self.rank, mask_v2a_keys=_mask_v2a_keys)
        elif self._single is not None:
            self._state = self._single
        if self._state is not None:
            install_attention_wrappers(model, self._state)

    def layout_for(self, video: Modality | None) -> CallLayout:
        """How a call with this ``video`` runs (:func:`ltx_mgpu.denoise.parallel.layout.call_layout`
        of the layout, its batch and the world size; one group, the plain model or Ulysses over
        every rank, at world size 1 or without video)."""
        batch = video.latent.shape[0] if video is not None else 1
        if self._state is None or video is None:
            return CallLayout((batch,), self.world_size)
        return call_layout(self.layout, batch, self.world_size)

    def forward(self, video: Modality | None, audio: Modality | None, perturbations=None):
        if video is not None:
            check_token_budget(video.latent.shape[1], self.max_tokens)
        if audio is not None:
            check_token_budget(audio.latent.shape[1], self.max_tokens, "audio", "latent frames and any reference audio")
        if self._state is None or video is None:
            return self.model(video, audio, perturbations)
        layout = self.layout_for(video)
        if layout.groups > 1:
            return self._grouped_forward(layout, video, audio, perturbations)
        return self._ulysses(self._state, video, audio, perturbations)

    def _grouped_forward(self, layout: CallLayout, video: Modality, audio: Modality | None, perturbations):
        """Each group of ranks runs its samples (and their perturbation configs), Ulysses-parallel
        over its ranks or, one rank per group, on the plain model (padded to its bucket with
        ``buckets``); then every rank gathers every
        group's outputs (padded to the largest group's samples for the one all-gather, then cut).
        The whole pool's attention wrappers are back in place when it returns."""
        batch, size = video.latent.shape[0], layout.ranks_per_group
        side = self.rank // size
        part = layout.part(side)
        v, a = _batch_slice(video, part, batch), (_batch_slice(audio, part, batch) if audio is not None else None)
        p = _perturbations_slice(perturbations, part)
        try:
            if size > 1:
                state = _group_state(self._group, self.world_size, self.rank, layout.groups, self._mask_v2a_keys)
                install_attention_wrappers(self.model, state)
                vx, ax = self._ulysses(state, v, a, p)
            elif self._single is not None:  # one rank per group, padded to its bucket
                install_attention_wrappers(self.model, self._single)
                vx, ax = self._ulysses(self._single, v, a, p)
            else:  # one rank per group: the plain model
                remove_attention_wrappers(self.model)
                vx, ax = self.model(v, a, p)
        finally:
            install_attention_wrappers(self.model, self._state)
        rows = max(layout.samples)
        outs = []
        for out in (vx, ax):
            if out is None:
                outs.append(None)
                continue
            if out.shape[0] < rows:  # a smaller group of an uneven split (cfg_ulysses, odd batch)
                out = torch.cat([out, out.new_zeros((rows - out.shape[0], *out.shape[1:]))])
            gathered = _all_gather_stacked(out, self.world_size, self._state.group)  # [W, rows, ...]
            outs.append(torch.cat([gathered[i * size][:n] for i, n in enumerate(layout.samples)]))
        return outs[0], outs[1]

    def padded_tokens(self, tokens: int, world: int | None = None) -> int:
        """The video token count a call of ``tokens`` runs at over ``world`` ranks (default: all
        of them): its bucket (``buckets``, :meth:`~ltx_mgpu.denoise.parallel.buckets.TokenBuckets.padded`)
        or, without buckets, the next multiple of ``world``."""
        world = self.world_size if world is None else world
        if self.buckets is not None:
            return self.buckets.padded(tokens, world, self.max_tokens)
        return -(-tokens // world) * world

    def _ulysses(self, s: _ShardState, video: Modality, audio: Modality | None, perturbations):
        """The video tokens split over the ranks of ``s`` (whose wrappers are installed), padded
        to :meth:`padded_tokens` (one padding for the split and the bucket)."""
        t = video.latent.shape[1]
        local, t_pad = shard_video(video, s.world, s.rank, self.padded_tokens(t, s.world))
        s.valid_tokens, s.padded_tokens = t, t_pad
        block = self.model.transformer_blocks[0]
        wrappers = [getattr(getattr(block, name, None), "attention_function", None) for name in _WRAPPERS]
        _ACTIVE.update({w.kind: w for w in wrappers if isinstance(w, tuple(_WRAPPERS.values()))})
        try:
            vx_local, ax = self.model(local, audio, perturbations)
        finally:
            s.valid_tokens = s.padded_tokens = 0
            _ACTIVE.clear()
        if s.world == 1:
            return vx_local[:, :t], ax
        gathered = _all_gather_stacked(vx_local, s.world, s.group)  # [W, B, T_loc, C]
        w, b, t_loc, c = gathered.shape
        vx = gathered.transpose(0, 1).reshape(b, w * t_loc, c)[:, :t]
        return vx, ax

    def remove(self) -> LTXModel:
        """Restore the model's original attention functions and return the plain model."""
        remove_attention_wrappers(self.model)
        self._state = None
        return self.model
