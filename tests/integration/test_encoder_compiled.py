"""The prompt encoder with its tower's layers through torch.compile (each new kind of batch
compiles on the CPU for seconds to minutes): the same rows as the eager encoder, NF4 refused, a
compiler that cannot work here reported when the encoder loads.
"""

from __future__ import annotations

import pytest
import torch

from ltx_mgpu.text.cache.keys import cache_key_parts
from ltx_mgpu.text.config import TextEncoderConfig
from ltx_mgpu.text.encoder.local import LocalTextEncoder


def test_a_compiled_spec_encodes_as_the_eager_one_and_refuses_nf4(tiny_gemma_dir, tiny_ltx_23, artifact):
    """compile=True: Gemma's decoder layers run through torch.compile (Inductor, on the CPU here),
    through a new batch length too (a recompile), and the embeddings equal the eager ones to
    float32 rounding; NF4 weights are refused before anything loads, whether asked for or found."""
    from torch._dynamo.utils import counters

    prompts = ["a red fox running through snow at dawn", "a lighthouse in a storm", "water"]
    eager = LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="float32")).build()
    spec = LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="float32", compile=True))
    graphs = counters["stats"]["unique_graphs"]
    compiled = spec.build()
    assert counters["stats"]["unique_graphs"] > graphs  # compiled while loading (one and two prompts)
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in compiled.tower.model.layers)
    assert not hasattr(eager.tower.model.layers[0].forward, "_torchdynamo_orig_callable")
    assert cache_key_parts(spec.config) == cache_key_parts(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23,
                                                                             dtype="float32"))
    for batch in (prompts, prompts[1:]):
        for c, e in zip(compiled.encode(batch), eager.encode(batch)):
            torch.testing.assert_close(c.tensor, e.tensor, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="compile works with bf16 weights"):
        LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, weights="nf4", compile=True))
    with pytest.raises(ValueError, match="compile works with bf16 weights"):
        LocalTextEncoder(TextEncoderConfig(artifact, tiny_ltx_23, compile=True)).build()
    with pytest.raises(ValueError, match="compile must be True or False"):
        LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, compile="yes"))


def test_a_compiler_that_fails_here_is_reported_when_the_encoder_loads(tiny_gemma_dir, tiny_ltx_23, monkeypatch):
    """build() compiles right away, so a torch.compile that cannot work on this machine (no C++
    compiler, a broken Triton: here a backend that raises) is a one-line ValueError naming the
    fix, not a traceback in the first encode."""
    import ltx_mgpu.text.encoder.prompt as encoder_module  # where compile_prompt_encoder looks it up

    real = encoder_module.compile_text_tower

    def broken_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(encoder_module, "compile_text_tower",
                        lambda tower, scope="model", **kw: real(tower, scope, backend=broken_backend))
    spec = LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="float32", compile=True))
    with pytest.raises(ValueError, match=r"torch.compile could not compile Gemma's layers on cpu: .*no compiler "
                                         r"here.*\(turn compile off"):
        spec.build()
