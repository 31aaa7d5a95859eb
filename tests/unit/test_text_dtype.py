"""Gemma's compute dtype ``auto``: what ComfyUI's own text encoder computes in on the device Gemma
runs on (``ltx_mgpu.text.config.resolve_text_dtype``), the Gemma Loader's default.

* The rule: float32 on CPU ranks, bfloat16 on GPUs, bfloat16 for NF4 weights whatever the device.
* Where it is resolved: the client from its pool's spec (before any cache key: an embedding
  depends on its dtype, so ``auto`` never reaches a key), the pool from its device (a request
  written by hand), an in-process encoder from its device. Named dtypes pass through unchanged.
* The node: ``dtype`` is an optional combo (``auto``, ``bf16``, ``fp32``, ``fp16``) defaulting to
  ``auto``, so a workflow saved before it existed runs with ``auto``; a bad value names the field.
"""

from __future__ import annotations

import dataclasses

import pytest
from nodes_support import NODES, run

from ltx_mgpu.choices import TEXT_COMPUTE_DTYPES
from ltx_mgpu.client.spec import PoolSpec
from ltx_mgpu.pool.text_jobs import parse_load_request
from ltx_mgpu.text.cache.keys import cache_key_parts, resolve_dtype
from ltx_mgpu.text.config import TextEncoderConfig, resolve_text_dtype
from ltx_mgpu.text.encoder.local import LocalTextEncoder


def test_auto_is_comfyuis_text_dtype_on_the_device():
    assert {(d, w): resolve_text_dtype(d, w) for d in ("cpu", "cuda") for w in ("bf16", "nf4")} == {
        ("cpu", "bf16"): "float32", ("cuda", "bf16"): "bfloat16",  # ComfyUI: fp32 activations; the GPU: bf16
        ("cpu", "nf4"): "bfloat16", ("cuda", "nf4"): "bfloat16"}  # NF4 computes in bf16 only


def test_the_config_keeps_auto_until_the_device_resolves_it(tiny_gemma_dir, tiny_ltx_23):
    auto = TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="auto")
    assert auto.dtype == "auto" and TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23).dtype == "bfloat16"
    assert resolve_dtype(auto, "cpu") == dataclasses.replace(auto, dtype="float32")
    assert resolve_dtype(auto, "cuda").dtype == "bfloat16"
    assert resolve_dtype(dataclasses.replace(auto, weights="nf4"), "cpu").dtype == "bfloat16"
    for named, want in (("fp16", "float16"), ("bf16", "bfloat16"), ("fp32", "float32")):
        config = TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype=named)
        assert config.dtype == want and resolve_dtype(config, "cpu") is config
    with pytest.raises(ValueError, match=r"unknown dtype 'fp64'; use one of \[.*'auto'\]"):
        TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="fp64")
    # the wire form carries auto as it is
    params = auto.to_params("k")
    assert params["dtype"] == "auto" and TextEncoderConfig.from_params(params) == (auto, "k")


def test_no_cache_key_is_made_of_auto(tiny_gemma_dir, tiny_ltx_23):
    auto = TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="auto")
    with pytest.raises(ValueError, match="compute dtype is 'auto': resolve it for the device Gemma runs on"):
        cache_key_parts(auto)
    assert cache_key_parts(resolve_dtype(auto, "cpu")).dtype == "float32"
    assert cache_key_parts(resolve_dtype(auto, "cpu")) == cache_key_parts(dataclasses.replace(auto, dtype="fp32"))


def test_the_pool_resolves_auto_for_its_device(tiny_gemma_dir, tiny_ltx_23):
    params = TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="auto").to_params("k")
    assert parse_load_request(params, 2, "cpu").config.dtype == "float32"
    assert parse_load_request(params, 2, "cuda").config.dtype == "bfloat16"  # headers only: no GPU needed
    assert parse_load_request({**params, "weights": "nf4"}, 2, "cpu").config.dtype == "bfloat16"
    named = parse_load_request({**params, "dtype": "bfloat16"}, 2, "cpu")
    assert named.config.dtype == "bfloat16"


def test_the_client_resolves_auto_from_its_pools_spec_before_any_key(tiny_gemma_dir, tiny_ltx_23, tmp_path):
    """``encode_prompts`` resolves for the pool's device from the spec alone: a fully cached
    prompt set is served without contacting the pool, from the entry the resolved dtype keys."""
    from ltx_mgpu.client.text import encode_prompts
    from ltx_mgpu.text.cache.store import EmbeddingCache

    auto = TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="auto")
    cache = EmbeddingCache(tmp_path / "cache")
    fp32 = LocalTextEncoder(dataclasses.replace(auto, dtype="fp32"))
    stored, _ = fp32.encode(["a fox"], cache=cache)

    class SpecOnly:  # a client that may be asked for its spec and nothing else
        def __init__(self, gpus):
            self.spec = PoolSpec(gpus, 2, "with-owner", tmp_path / "rt")

        def __getattr__(self, name):
            raise AssertionError(f"the pool was contacted ({name})")

    got, report = encode_prompts(SpecOnly(()), auto, ["a fox"], cache=cache)
    assert report.hits == 1 and got[0].tensor.equal(stored[0].tensor)
    with pytest.raises(AssertionError, match="the pool was contacted"):  # on GPUs auto is bf16: not cached
        encode_prompts(SpecOnly((0, 1)), auto, ["a fox"], cache=cache)


def test_an_in_process_encoder_resolves_auto_for_its_device(tiny_gemma_dir, tiny_ltx_23):
    auto = TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="auto")
    assert LocalTextEncoder(auto, "cpu").config.dtype == "float32"
    assert LocalTextEncoder(auto, "cuda:1").config.dtype == "bfloat16"  # nothing is loaded at construction


def test_the_gemma_loader_defaults_to_auto_and_a_workflow_without_the_widget_gets_it(env):
    inputs = {i.id: i for i in NODES["LTXMGPU_GemmaLoader"].define_schema().inputs}
    dtype = inputs["dtype"]
    assert dtype.options == list(TEXT_COMPUTE_DTYPES) == ["auto", "bf16", "fp32", "fp16"]
    assert dtype.default == "auto" and dtype.optional
    assert list(inputs)[-1] == "dtype"  # last: a saved workflow's widget values keep their positions
    args = (None, "tiny-gemma/", "checkpoints/tiny-ltx-2.3.safetensors", "bf16", "single", True)
    old = run("LTXMGPU_GemmaLoader", *args)[0]  # as a workflow saved without the widget runs
    assert old.config.dtype == "auto"
    assert run("LTXMGPU_GemmaLoader", *args, False, "fp32")[0].config.dtype == "float32"
    with pytest.raises(ValueError, match="dtype must be one of 'auto', 'bf16', 'fp32' or 'fp16', got 'float64'"):
        run("LTXMGPU_GemmaLoader", *args, dtype="float64")
