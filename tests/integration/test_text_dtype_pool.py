"""The Gemma Loader at its defaults on a real 2-rank CPU pool computes Gemma in float32, as ComfyUI's
own text encoder does on the CPU (``dtype`` ``auto``: tests/unit/test_text_dtype.py has the rule):
the pool reports the resolved dtype, and Prompt Encode and the CLIP equal an in-process fp32
encoder to fp32 rounding."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from nodes_support import cpu_pool, run

from ltx_mgpu.text.encoder.local import LocalTextEncoder

PROMPTS = ("a heron stands in the reeds at dusk", "blurry")


@pytest.fixture(scope="module")
def pool(env):
    with cpu_pool() as handle:
        yield handle


def test_the_default_dtype_on_a_cpu_pool_is_float32(pool):
    te, clip = run("LTXMGPU_GemmaLoader", pool, "tiny-gemma-comfy.safetensors", "checkpoints/tiny-ltx-2.3.safetensors",
                   "bf16", "single", True).result
    assert te.config.dtype == "auto"
    with torch.inference_mode():
        pos, neg = run("LTXMGPU_PromptEncode", te, *PROMPTS, False, unique_id="3").result
        via_clip = clip.encode_from_tokens_scheduled(clip.tokenize(PROMPTS[0]))
    resident = pool.client.status()["ranks"][0]["models"]["text_encoder"]
    assert resident["dtype"] == "float32", resident
    reference = LocalTextEncoder(dataclasses.replace(te.config, dtype="fp32")).build().encode(list(PROMPTS))
    for cond, ref in zip((pos, neg), reference):
        torch.testing.assert_close(cond[0][0][0], ref.tensor, rtol=1e-5, atol=1e-6)
    assert torch.equal(via_clip[0][0], pos[0][0])
    bf16 = LocalTextEncoder(dataclasses.replace(te.config, dtype="bf16")).build().encode([PROMPTS[0]])[0].tensor
    assert not torch.allclose(bf16, reference[0].tensor, rtol=1e-4, atol=1e-5)  # the check can tell them apart
