"""Helpers shared by the text-pool tests: the prompts, in-process reference embeddings, an
uncached encode through a pool and the check of its result (``checkpoints`` is in conftest.py)."""

from __future__ import annotations

import hashlib

import torch

from ltx_mgpu.client.text import embeddings_from_result, pool_key
from ltx_mgpu.text.config import TextEncoderConfig
from ltx_mgpu.text.encoder.local import LocalTextEncoder

PROMPTS = [
    "a red fox running through snow at dawn",
    "a lighthouse in a storm",
    "the quick brown fox jumps over the lazy dog while the camera pans slowly to the left",
    "water",
    "a city at night with neon lights reflected in puddles",
    "two cats",
    "an astronaut floating above the earth, the sun rising behind",
]


_REFERENCE: dict = {}


def reference(gemma, ckpt, prompts, weights="bf16", dtype="float32", batch_size=None):
    """In-process embeddings (``LocalTextEncoder.build().encode``): one prompt at a time, or in
    sub-batches of ``batch_size`` (bf16 results depend on the batch's padding, fp32 ones agree)."""
    spec = _REFERENCE.get((gemma, ckpt, weights, dtype))
    if spec is None:
        spec = _REFERENCE[(gemma, ckpt, weights, dtype)] = LocalTextEncoder(TextEncoderConfig(gemma, ckpt, weights,
                                                                                              dtype=dtype))
    if batch_size:
        return spec.build().encode(prompts, batch_size=batch_size)
    return [spec.build().encode([p])[0] for p in prompts]


def encode(client, encoder, prompts, batch_size=2, verify=True, on_progress=None):
    """Load (if needed) and encode through the pool without the cache; returns (result, tensors)."""
    from ltx_mgpu.client.text import ensure_text_encoder

    key = pool_key(encoder)
    ensure_text_encoder(client, encoder, key, timeout=120)
    return client.request("encode", {"prompts": prompts, "batch_size": batch_size, "expect": key, "verify": verify},
                          on_progress=on_progress, timeout=120)


def check(result, tensors, reference, world_size):
    assert result["count"] == len(reference)
    embeddings = embeddings_from_result(result, tensors)  # float32 upcasts of the wire dtype
    for i, (ref, emb) in enumerate(zip(reference, embeddings)):
        assert str(tensors[f"prompt_{i}"].dtype) == "torch." + result["wire_dtype"]
        got = emb.tensor
        assert got.dtype == torch.float32 and got.shape == ref.tensor.shape
        torch.testing.assert_close(got, ref.tensor, rtol=1e-5, atol=1e-5)
        assert result["dropped_tokens"][i] == ref.dropped_tokens and result["version"] == ref.version
    # every rank holds every prompt's embedding, bit for bit what rank 0 returned
    returned = [hashlib.sha256(e.tensor.contiguous().numpy().tobytes()).hexdigest() for e in embeddings]
    assert len(result["rank_digests"]) == world_size and result["consistent"]
    assert all(d == returned for d in result["rank_digests"])
