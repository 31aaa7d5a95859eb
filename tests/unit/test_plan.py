"""The transformer's plan (``ltx_mgpu.denoise.plan``): one frozen value per load, checked once
where a request is parsed, and what follows from it (compute dtype, how the linears run)."""

from __future__ import annotations

import os

import pytest

from ltx_mgpu.choices import SP_LAYOUTS, TRANSFORMER_DTYPES, TRANSFORMER_WEIGHTS
from ltx_mgpu.denoise.plan import Fp8Config, LoraSpec, TransformerPlan
from ltx_mgpu.wire.messages import REQUESTS


def test_a_plan_derives_the_compute_dtype_and_how_the_linears_run():
    plan = TransformerPlan("ckpt.safetensors")
    assert plan.checkpoint == os.path.abspath("ckpt.safetensors")  # the pool's working directory is not ours
    assert (plan.dtype, plan.weights, plan.layout, plan.storage) == ("bf16", "replicated", "auto", None)
    assert {d: TransformerPlan("/c", dtype=d).compute_dtype for d in TRANSFORMER_DTYPES} == {
        "bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "fp8": "bfloat16"}
    # fp8 compute whatever the file; a sharded fp8 file keeps its e4m3 (upcast per call); else dense
    assert TransformerPlan("/c", dtype="fp8").linears == "fp8"
    assert TransformerPlan("/c", dtype="fp8").fp8 == Fp8Config("fp8")
    for weights in TRANSFORMER_WEIGHTS:
        for storage in ("dense", "e4m3", "ggml", "comfy_quant"):
            plan = TransformerPlan("/c", dtype="fp32", weights=weights).with_storage(storage)
            want = {"ggml": "packed", "comfy_quant": "packed",
                    "e4m3": "upcast" if weights == "sharded" else "dense"}.get(storage, "dense")
            assert plan.linears == want, (weights, storage)
            assert plan.fp8 == (Fp8Config("upcast") if plan.linears == "upcast" else None)
    with pytest.raises(ValueError, match="c is a GGUF file: its quantized blocks run with dtype bf16, fp16 or fp32"):
        TransformerPlan("/c", dtype="fp8").with_storage("ggml")
    described = TransformerPlan("/c", dtype="fp8", weights="sharded").with_storage("e4m3").describe()
    assert described == {"dtype": "fp8", "compute_dtype": "bfloat16", "linears": "fp8", "weights": "sharded",
                         "storage": "e4m3", "layout": "auto", "max_tokens": 32768, "attention_type": None,
                         "connectors": None, "compile": "auto", "compiled": True}


def test_the_plan_travels_as_the_load_request_and_comes_back_equal(tmp_path):
    lora = tmp_path / "l.safetensors"
    plan = TransformerPlan(tmp_path / "c.safetensors", dtype="fp16", weights="sharded", layout="cfg_ulysses",
                           loras=[(lora, 0.5), LoraSpec(str(lora), -1)], max_tokens=4096, attention_type="pytorch",
                           connectors=tmp_path / "connectors.safetensors", compile="on")
    assert plan.loras == (LoraSpec(str(lora), 0.5), LoraSpec(str(lora), -1.0))
    params = {**plan.to_params(), "name": "ltx"}
    REQUESTS["load_transformer"].validate(params, "load_transformer")  # the wire takes it as it is
    assert TransformerPlan.from_params(params) == plan
    assert TransformerPlan.from_params({"checkpoint": "/c"}) == TransformerPlan("/c")


@pytest.mark.parametrize("fields, match", [
    ({"dtype": "fp64"}, r"dtype must be one of 'bf16', 'fp16', 'fp32' or 'fp8', got 'fp64'"),
    ({"weights": "halves"}, r"weights must be one of 'replicated' or 'sharded', got 'halves'"),
    ({"layout": "ring"}, r"layout must be one of 'auto', 'ulysses' or 'cfg_ulysses', got 'ring'"),
    ({"attention_type": "sdpa"}, r"attention_type must be one of 'default', 'pytorch', 'xformers', "
                                 r"'flash_attention_3' or 'triton_8bit', got 'sdpa'"),
    ({"max_tokens": 0}, "max_tokens must be a positive number of video tokens, got 0"),
    ({"max_tokens": True}, "max_tokens must be a positive number of video tokens, got True"),
    ({"loras": [{"path": "/l", "strength": float("nan")}]}, r"loras\[0\]\.strength must be in -100\.\.100"),
    ({"loras": [{"path": "/l", "strength": 101}]}, r"loras\[0\]\.strength must be in -100\.\.100"),
    ({"loras": [{"path": "/l", "strength": "1"}]}, r"loras\[0\]\.strength must be a number, got '1'"),
    ({"loras": [{"path": 3}]}, r"loras\[0\]\.path must be a file path, got 3"),
    ({"loras": [{"path": "/l", "weight": 1}]}, r"loras\[0\] has unknown field\(s\) \['weight'\]"),
    ({"loras": "a.safetensors"}, "loras must be a list of LoRAs, got str"),
    ({"storage": "int4"}, "storage must be one of 'dense', 'e4m3', 'ggml' or 'comfy_quant'"),
    ({"compile": "max-autotune"}, "compile must be one of 'auto' or 'on', got 'max-autotune'"),
    ({"compile": "on", "storage": "ggml"}, r"c is a GGUF file: its quantized blocks run eagerly .*set compile to auto"),
])
def test_every_field_is_checked_once_when_the_plan_is_built(fields, match):
    with pytest.raises(ValueError, match=match):
        TransformerPlan("/c", **fields)


def test_the_pool_parses_the_request_into_a_plan_and_refuses_what_it_does_not_know():
    with pytest.raises(ValueError, match=r"load_transformer has unknown field\(s\) \['fp8'\]"):
        TransformerPlan.from_params({"checkpoint": "/c", "fp8": True})
    with pytest.raises(ValueError, match="checkpoint must be an absolute path"):
        TransformerPlan.from_params({"checkpoint": "c.safetensors"})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['storage'\]"):  # the pool reads it from the file
        TransformerPlan.from_params({"checkpoint": "/c", "storage": "e4m3"})


def test_the_wire_schema_types_the_plans_fields_and_leaves_their_values_to_the_plan():
    """The choices are checked in one place: the plan (the schema would otherwise be a second)."""
    fields = {f.name: f for f in REQUESTS["load_transformer"].fields}
    for name in ("dtype", "weights", "layout", "attention_type", "compile"):
        assert fields[name].choices is None, name
    text = {f.name: f for f in REQUESTS["load_text_encoder"].fields}
    assert text["weights"].choices is None and text["placement"].choices is None  # TextEncoderConfig's
    assert set(SP_LAYOUTS) == {"auto", "ulysses", "cfg_ulysses"}


def test_compile_auto_compiles_fp8_only_and_on_compiles_every_dense_dtype():
    for dtype in TRANSFORMER_DTYPES:
        assert TransformerPlan("/c", dtype=dtype).compiled == (dtype == "fp8"), dtype
        assert TransformerPlan("/c", dtype=dtype, compile="on").compiled, dtype
    assert TransformerPlan("/c", compile="on").with_storage("e4m3").compiled
    for storage, kind in (("ggml", "a GGUF file"), ("comfy_quant", "ComfyUI-quantized")):
        with pytest.raises(ValueError, match=f"c.safetensors is .*{kind}.*set compile to auto"):
            TransformerPlan("/c.safetensors", compile="on").with_storage(storage)
        assert not TransformerPlan("/c").with_storage(storage).compiled
