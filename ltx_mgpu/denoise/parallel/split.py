"""What sequence parallelism can serve, checked before any GPU work and identically on every
rank: the world size must divide the attention heads Ulysses splits, and the video latent must
fit the token budget (``ltx_mgpu.denoise.parallel.ulysses`` runs the split)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ltx_core.model.transformer.model import LTXModel

__all__ = ["SequenceParallelConfigError", "check_sequence_parallel_config", "check_token_budget",
           "valid_world_sizes"]


class SequenceParallelConfigError(ValueError):
    """A request sequence parallelism cannot serve (head split or token budget).

    Raised identically on every rank before any collective, so the pool can report it as a
    ``bad_input`` error and keep serving.
    """


def _head_counts(model: "LTXModel") -> dict[str, int]:
    """The head counts SP splits: video self-attention and (AV models) V2A's audio heads."""
    counts = {}
    if model.model_type.is_video_enabled():
        counts["video"] = int(model.num_attention_heads)
        if model.model_type.is_audio_enabled():
            counts["audio"] = int(model.audio_num_attention_heads)
    return counts


def valid_world_sizes(model: "LTXModel") -> list[int]:
    """World sizes (GPU counts) that divide every head count SP splits for ``model``."""
    counts = list(_head_counts(model).values())
    g = math.gcd(*counts) if counts else 1
    return [d for d in range(1, g + 1) if g % d == 0]


def check_sequence_parallel_config(model: "LTXModel", world_size: int) -> None:
    """Raise ``SequenceParallelConfigError`` unless ``world_size`` divides the split heads.

    Video self-attention splits ``num_attention_heads`` and video->audio cross-attention
    splits ``audio_num_attention_heads`` across the ranks (Ulysses), so both must divide.
    """
    counts = _head_counts(model)
    bad = {name: h for name, h in counts.items() if h % world_size}
    if not bad:
        return
    heads = " and ".join(f"{h} {name} attention heads" for name, h in counts.items())
    sizes = ", ".join(str(s) for s in valid_world_sizes(model))
    raise SequenceParallelConfigError(
        f"sequence parallelism splits attention heads across the pool's ranks (one per GPU), and this model "
        f"has {heads}; {world_size} ranks do not divide them. Start the pool on one of these rank (GPU) "
        f"counts instead: {sizes}."
    )


def check_token_budget(num_tokens: int, max_tokens: int) -> None:
    """Raise ``SequenceParallelConfigError`` when ``num_tokens`` video tokens exceed the budget.

    Video tokens = latent frames x latent height x latent width (e.g. 121 frames at
    1024x1536 -> 16*32*48 = 24,576).
    """
    if num_tokens > max_tokens:
        raise SequenceParallelConfigError(
            f"the video latent has {num_tokens} tokens (latent frames x height x width), more than "
            f"max_tokens={max_tokens}. Lower the resolution or the number of frames, or raise the "
            f"budget when loading the model (it bounds activation memory per GPU): the Model Loader "
            f"node's max_tokens, generate --max-tokens, or load_transformer's max_tokens."
        )
