"""What Ulysses sequence parallelism splits across the ranks, declared as data (:data:`ULYSSES_SPLIT`),
and what that asks of a model and of a call, checked before any GPU work and identically on every
rank: the world size must divide the attention heads the split exchanges, and the video latent
must fit the token budget. :mod:`ltx_mgpu.denoise.parallel.ulysses` runs the split, its attention
wrappers chosen from the same declaration.

The split (ltx-core 1.0.0's ``BasicAVTransformerBlock``): the video tokens are split (padded to a
multiple of the world size); audio tokens, text contexts and every per-token module (FFNs, AdaLN,
``attn2``, ``audio_to_video_attn`` whose queries are local video tokens, the audio modules) stay
replicated or local. Two attention modules per block need the whole video sequence.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ltx_core.model.transformer.model import LTXModel

__all__ = ["ULYSSES_SPLIT", "AttentionSplit", "SequenceParallelConfigError", "SplitPlan",
           "check_sequence_parallel_config", "check_token_budget", "valid_world_sizes"]


@dataclasses.dataclass(frozen=True)
class AttentionSplit:
    """How one attention module of every transformer block runs under Ulysses.

    Attributes:
        label: what its split heads are called in messages (``video``, ``audio``).
        module: the block's attribute (``attn1``, ``video_to_audio_attn``).
        queries: ``"split"`` (video tokens: exchanged tokens -> heads with one all-to-all, the
            result back heads -> tokens) or ``"replicated"`` (audio: each rank keeps its ``H/W``
            query heads, the head outputs are all-gathered).
        heads: the ``LTXModel`` attribute holding the head count the world size must divide.
        modalities: the modalities the model must have for the module to exist.
    """

    label: str
    module: str
    queries: str
    heads: str
    modalities: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """What one sequence-parallel call splits: the tokens of ``split_modality``, and the attention
    modules that exchange heads (their keys and values are always the split tokens)."""

    split_modality: str
    attention: tuple[AttentionSplit, ...]

    def head_counts(self, model: "LTXModel") -> dict[str, int]:
        """The head count of every module the split exchanges on ``model``, by label."""
        enabled = {"video": model.model_type.is_video_enabled(), "audio": model.model_type.is_audio_enabled()}
        return {a.label: int(getattr(model, a.heads)) for a in self.attention
                if all(enabled[m] for m in a.modalities)}


#: LTX-2's Ulysses split: video self-attention (queries, keys and values all video tokens) and
#: video -> audio cross-attention (audio queries, replicated; video keys and values, split).
ULYSSES_SPLIT = SplitPlan("video", (
    AttentionSplit("video", "attn1", "split", "num_attention_heads", ("video",)),
    AttentionSplit("audio", "video_to_audio_attn", "replicated", "audio_num_attention_heads", ("video", "audio")),
))


class SequenceParallelConfigError(ValueError):
    """A request sequence parallelism cannot serve (head split or token budget).

    Raised identically on every rank before any collective, so the pool can report it as a
    ``bad_input`` error and keep serving.
    """


def valid_world_sizes(model: "LTXModel") -> list[int]:
    """World sizes (GPU counts) that divide every head count SP splits for ``model``."""
    counts = list(ULYSSES_SPLIT.head_counts(model).values())
    g = math.gcd(*counts) if counts else 1
    return [d for d in range(1, g + 1) if g % d == 0]


def check_sequence_parallel_config(model: "LTXModel", world_size: int) -> None:
    """Raise ``SequenceParallelConfigError`` unless ``world_size`` divides the split heads.

    Video self-attention splits ``num_attention_heads`` and video->audio cross-attention
    splits ``audio_num_attention_heads`` across the ranks (:data:`ULYSSES_SPLIT`), so both must
    divide.
    """
    counts = ULYSSES_SPLIT.head_counts(model)
    bad = {name: h for name, h in counts.items() if h % world_size}
    if not bad:
        return
    heads = " and ".join(f"{h} {label} attention heads" for label, h in counts.items())
    sizes = ", ".join(str(s) for s in valid_world_sizes(model))
    raise SequenceParallelConfigError(
        f"sequence parallelism splits attention heads across the pool's ranks (one per GPU), and this model "
        f"has {heads}; {world_size} ranks do not divide them. Start the pool on one of these rank (GPU) "
        f"counts instead: {sizes}."
    )


def check_token_budget(num_tokens: int, max_tokens: int, modality: str = "video", detail: str | None = None) -> None:
    """Raise ``SequenceParallelConfigError`` when a call's ``num_tokens`` tokens of ``modality``
    (``"video"`` or ``"audio"``) exceed the budget the model was loaded with.

    Video tokens = latent frames x latent height x latent width (e.g. 121 frames at
    1024x1536 -> 16*32*48 = 24,576); audio tokens = latent frames (25 per second of audio), with
    the reference audio's (``LTXVReferenceAudio``) prepended to them: ``detail`` says how they add
    up, for the message. Audio tokens are replicated on every rank and attend to each other, so
    the same budget bounds them.
    """
    if num_tokens <= max_tokens:
        return
    fix = ("raise the budget when loading the model (it bounds activation memory per GPU): the Model Loader "
           "node's max_tokens, generate --max-tokens, or load_transformer's max_tokens.")
    if modality == "video":
        raise SequenceParallelConfigError(
            f"the video latent has {num_tokens} tokens (latent frames x height x width), more than "
            f"max_tokens={max_tokens}. Lower the resolution or the number of frames, or {fix}"
        )
    raise SequenceParallelConfigError(
        f"the audio latent has {num_tokens} tokens ({detail or 'latent frames'}), more than max_tokens={max_tokens}. "
        f"Use a shorter clip (or reference audio), or {fix}"
    )
