"""ComfyUI's token sampler as a transformers logits processor: :class:`ComfySampling`.

transformers' ``generate`` turns the processed scores into a token (softmax, then
``torch.multinomial`` on the device's default generator; the argmax when not sampling). What
ComfyUI does before that draw (``BaseGenerate.sample_token`` in ``comfy/text_encoders/llama.py``)
is this processor's, in ComfyUI's order and arithmetic:

1. repetition penalty over the tokens generated so far (not the prompt's: ComfyUI's history
   starts empty): a negative logit times the penalty, another times ``1 / penalty``;
2. presence penalty: minus the penalty, for the same tokens;
3. ``logits / temperature`` (when not 1);
4. top-k (when > 0): logits under the k-th largest set to ``finfo.min``;
5. min-p (when > 0): tokens whose probability is under ``min_p`` x the top one's set to
   ``finfo.min``;
6. top-p (when < 1): sorted descending, the tokens after the cumulative probability passes
   ``top_p`` (the first one always kept) set to ``finfo.min``.

transformers' own warpers (its repetition penalty covers the prompt, divides instead of
multiplying by the reciprocal, applies top-p before min-p and uses ``-inf``) are not used
(:mod:`~ltx_mgpu.text.generate.causal_lm` turns them all off). ComfyUI samples in its execution
dtype (bf16 on GPUs that take it, float32 on the CPU): the scores transformers hands over
(float32 upcasts of the model's logits) are processed in ``dtype``, the model's compute dtype,
and returned in it, so the softmax and the draw see the values ComfyUI's do. With the same seed
(the device's default generator seeded as ComfyUI seeds its own ``torch.Generator``: same
algorithm, same state) the draws are then ComfyUI's for the same logits.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from ltx_mgpu.text.generate.options import GenerateOptions

__all__ = ["ComfySampling"]


class ComfySampling(LogitsProcessor):
    """ComfyUI's ``sample_token`` warping (module doc) for one generation.

    Args:
        options: the generation's options (sampling on).
        prompt_length: the prompt's ids in ``input_ids`` (the history starts after them).
        dtype: the model's compute dtype (what ComfyUI samples in).
    """

    def __init__(self, options: GenerateOptions, prompt_length: int, dtype: torch.dtype):
        self.options, self.prompt_length, self.dtype = options, prompt_length, dtype

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """``scores`` ``[B, V]`` (float32) -> the warped logits ``[B, V]`` in :attr:`dtype`."""
        o = self.options
        logits = scores.to(self.dtype, copy=True)
        history = input_ids[:, self.prompt_length:]
        if history.shape[1] and (o.repetition_penalty != 1.0 or o.presence_penalty != 0.0):
            for i in range(logits.shape[0]):
                seen = torch.unique(history[i])
                picked = logits[i, seen]
                if o.repetition_penalty != 1.0:
                    picked = torch.where(picked < 0, picked * o.repetition_penalty,
                                         picked * (1 / o.repetition_penalty))
                if o.presence_penalty != 0.0:
                    picked = picked - o.presence_penalty
                logits[i, seen] = picked
        if o.temperature != 1.0:
            logits = logits / o.temperature
        lowest = torch.finfo(logits.dtype).min
        if o.top_k > 0:
            k = min(o.top_k, logits.shape[-1])
            logits[logits < torch.topk(logits, k)[0][..., -1, None]] = lowest
        if o.min_p > 0.0:
            probs = torch.nn.functional.softmax(logits, dim=-1)
            top = probs.max(dim=-1, keepdim=True)[0]
            logits[probs < o.min_p * top] = lowest
        if o.top_p < 1.0:
            ordered, order = torch.sort(logits, descending=True)
            cumulative = torch.cumsum(torch.nn.functional.softmax(ordered, dim=-1), dim=-1)
            drop = cumulative > o.top_p
            drop[..., 0] = False
            logits[torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order, drop)] = lowest
        return logits
