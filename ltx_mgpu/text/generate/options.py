"""What one generation asks for: :class:`GenerateOptions`, the one config of a ``generate`` request.

The fields are the arguments of ComfyUI's ``CLIP.generate`` (``comfy/sd.py``; ``TextGenerate`` in
``comfy_extras/nodes_textgen.py`` passes them from its inputs) plus the two things ComfyUI's LTX-2
Gemma fixes elsewhere: its stop tokens (``<end_of_turn>`` only: ``Gemma3_12BModel.generate`` in
``comfy/text_encoders/lt.py``) and the left padding of the prompt to 1024 tokens
(``Gemma3_12BTokenizer``'s ``min_length``, which the template's ``min_length=1`` does not reach:
``Gemma3_Tokenizer.tokenize_with_weights`` does not pass it on). The client builds one from the
node's call, the pool rebuilds it from the request (:meth:`GenerateOptions.from_params`); both
check it the same way, here.

A leaf module (no torch).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from ltx_mgpu.wire.messages import MAX_NEW_TOKENS, MAX_STOP_TOKENS, MAX_TEXT_TOKENS

__all__ = ["END_OF_TURN", "COMFY_PAD_TO", "GenerateOptions"]

#: Gemma 3's ``<end_of_turn>``: the one stop token of ComfyUI's LTX-2 Gemma.
END_OF_TURN = 106
#: ComfyUI's LTX-2 Gemma tokenizer pads every prompt on the left to this many tokens (``<pad>``).
COMFY_PAD_TO = 1024
#: The largest seed (ComfyUI's seed inputs, and ``torch.Generator.manual_seed``, take 0..2**64-1).
_MAX_SEED = (1 << 64) - 1


def _number(value: Any, name: str, low: float, high: float, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"generate {name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"generate {name} must be in {low:g}..{high:g}, got {value!r}; {fix}")
    return float(value)


def _int(value: Any, name: str, low: int, high: int, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"generate {name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"generate {name} must be in {low}..{high}, got {value!r}; {fix}")
    return value


@dataclass(frozen=True)
class GenerateOptions:
    """ComfyUI's ``CLIP.generate`` arguments (the defaults are ``CLIP.generate``'s) and the LTX-2
    Gemma's fixed settings.

    Attributes:
        do_sample: sample (False: greedy, the argmax token every step; ComfyUI then ignores
            every other sampling option, penalties included).
        max_length: the most tokens to generate (the stop token counts), 1..``MAX_NEW_TOKENS``.
        temperature: divides the logits; 0 means greedy (as ComfyUI's ``sample_token``).
        top_k: keep the ``k`` largest logits (0: off).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p`` (1: off).
        min_p: drop tokens under ``min_p`` times the top token's probability (0: off).
        repetition_penalty: ComfyUI's: each token already *generated* (not the prompt's) has its
            logit multiplied by it when negative, divided by it otherwise (1: off); > 0.
        presence_penalty: subtracted from the logit of each token already generated (0: off).
        seed: the sampler's random seed, 0..2**64-1; needed when sampling.
        stop_tokens: token ids that end the generation (included in the output, as ComfyUI's).
        pad_to: the prompt is left-padded with ``<pad>`` to this many tokens (ComfyUI's 1024);
            0 leaves it as it is.

    Raises (at construction):
        ValueError: a field of the wrong type or out of its range, naming it and the fix;
            sampling without a seed.
    """

    do_sample: bool = True
    max_length: int = 256
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 0.95
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop_tokens: tuple[int, ...] = (END_OF_TURN,)
    pad_to: int = COMFY_PAD_TO

    def __post_init__(self) -> None:
        if not isinstance(self.do_sample, bool):
            raise ValueError(f"generate do_sample must be True or False, got {self.do_sample!r}")
        _int(self.max_length, "max_length", 1, MAX_NEW_TOKENS, "generate fewer tokens")
        fix = "ComfyUI's TextGenerate takes 0.01..2.0"
        object.__setattr__(self, "temperature", _number(self.temperature, "temperature", 0.0, 1e4, fix))
        _int(self.top_k, "top_k", 0, 1 << 31, "0 turns top-k off")
        object.__setattr__(self, "top_p", _number(self.top_p, "top_p", 0.0, 1.0, "1 turns top-p off"))
        object.__setattr__(self, "min_p", _number(self.min_p, "min_p", 0.0, 1.0, "0 turns min-p off"))
        penalty = _number(self.repetition_penalty, "repetition_penalty", 0.0, 1e4, "1 turns it off")
        if penalty <= 0.0:
            raise ValueError(f"generate repetition_penalty must be > 0 (it divides positive logits), got "
                             f"{self.repetition_penalty!r}; 1 turns it off")
        object.__setattr__(self, "repetition_penalty", penalty)
        object.__setattr__(self, "presence_penalty",
                           _number(self.presence_penalty, "presence_penalty", -1e4, 1e4, "0 turns it off"))
        if self.seed is not None:
            _int(self.seed, "seed", 0, _MAX_SEED, "ComfyUI's seeds are 0..2**64-1")
        elif self.do_sample and self.temperature != 0.0:
            raise ValueError("generate needs a seed when sampling (do_sample on); give one, or turn sampling off")
        stops = tuple(self.stop_tokens)
        if len(stops) > MAX_STOP_TOKENS:
            raise ValueError(f"generate takes at most {MAX_STOP_TOKENS} stop tokens, got {len(stops)}")
        for t in stops:
            _int(t, "stop_tokens[...]", 0, 1 << 31, "give token ids")
        object.__setattr__(self, "stop_tokens", stops)
        _int(self.pad_to, "pad_to", 0, MAX_TEXT_TOKENS, "ComfyUI pads to 1024 tokens")

    @property
    def greedy(self) -> bool:
        """The argmax token every step: sampling off, or a temperature of 0 (ComfyUI's rule)."""
        return not self.do_sample or self.temperature == 0.0

    # ---- the wire form (the ``generate`` request's params, besides ``text`` / ``expect`` / ``patches``)

    def to_params(self) -> dict:
        """The ``generate`` request's option fields."""
        params = asdict(self)
        params["stop_tokens"] = list(self.stop_tokens)
        return params

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> GenerateOptions:
        """The options of a ``generate`` request (absent fields take the defaults).

        Raises:
            ValueError: as the constructor.
        """
        names = {f.name for f in fields(cls)}
        return cls(**{k: (tuple(v) if k == "stop_tokens" else v) for k, v in params.items() if k in names})
