"""attention_type ``triton_8bit`` where no GPU runs it: the choice is taken and installed in every
ltx-core attention module (under the Ulysses wrappers), a mask falls back to ltx-core's SDPA
bit for bit, a call or a load without a Hopper GPU is refused naming the fix, and the float32
emulation of the kernel's rounding backs the formats its docstring chose. The kernel's own
numerics are tested on a GPU (``tests/test_cuda.py``)."""

from __future__ import annotations

import pytest
import torch
from ltx_core.model.transformer.attention import Attention, AttentionFunction, PytorchAttention
from sp_harness import build_tiny_model

from ltx_mgpu.choices import ATTENTION_TYPES
from ltx_mgpu.denoise.attention import kernel
from ltx_mgpu.denoise.attention.function import (
    TRITON_8BIT,
    TritonAttention,
    attention_function,
    core_attention_type,
    install,
    support_error,
    traceable,
)
from ltx_mgpu.denoise.compiling import graph_key
from ltx_mgpu.denoise.model import load_ltx_model
from ltx_mgpu.denoise.parallel.ulysses import install_attention_wrappers, remove_attention_wrappers
from ltx_mgpu.denoise.plan import TransformerPlan


def _qkv(b=2, tq=77, tk=300, heads=4, d=64, seed=0, dtype=torch.float32):
    """RMS-normalized q and k (times 1.5, as after ltx-core's q_norm / k_norm with a gain), v
    standard normal, ``[B, T, H*D]``."""
    g = torch.Generator().manual_seed(seed)

    def normed(t):
        x = torch.randn(b, t, heads, d, generator=g)
        return (1.5 * x / x.pow(2).mean(-1, keepdim=True).sqrt()).flatten(2).to(dtype)

    return normed(tq), normed(tk), torch.randn(b, tk, heads * d, generator=g).to(dtype)


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_the_choice_is_a_plan_choice_and_stands_for_our_callable():
    assert TRITON_8BIT in ATTENTION_TYPES
    assert TransformerPlan("/m.safetensors", attention_type=TRITON_8BIT).attention_type == TRITON_8BIT
    assert isinstance(attention_function(TRITON_8BIT), TritonAttention)
    assert attention_function("pytorch") is AttentionFunction.PYTORCH
    assert core_attention_type(TRITON_8BIT) == "pytorch" and core_attention_type("xformers") == "xformers"


def test_a_mask_falls_back_to_ltx_cores_sdpa_bit_for_bit():
    q, k, v = _qkv()
    mask = torch.zeros(1, 1, 1, 300)
    mask[..., 250:] = torch.finfo(torch.float32).min
    want = PytorchAttention()(q, k, v, 4, mask)
    assert torch.equal(TritonAttention()(q, k, v, 4, mask), want)


def test_a_call_or_a_load_without_a_hopper_gpu_is_refused_naming_the_fix():
    err = support_error("cpu")
    assert err is not None and f"'{TRITON_8BIT}' cannot run on cpu" in err and "'pytorch'" in err
    q, k, v = _qkv(dtype=torch.bfloat16)
    if not kernel.available("cpu"):  # Triton's CPU interpreter (TRITON_INTERPRET=1) would run it
        with pytest.raises(RuntimeError, match="needs Triton and a CUDA GPU"):
            TritonAttention()(q, k, v, 4)


@pytest.mark.parametrize("change, match", [
    (lambda t: t.float(), "bfloat16 or float16.*'pytorch'"),
    (lambda t: torch.cat([t, t[..., :32]], -1), "head dims \\(64, 128\\), got 72.*'pytorch'"),
])
def test_inputs_outside_the_kernels_contract_are_refused_naming_the_fix(change, match):
    q, k, v = (change(t) for t in _qkv(dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=match):
        kernel.attend(q, k, v, 4)


def test_install_reaches_every_attention_module_and_the_ulysses_wrappers_keep_it():
    model = build_tiny_model()
    fn = TritonAttention()
    modules = [m for m in model.modules() if isinstance(m, Attention)]
    assert install(model, fn) == len(modules) > 0
    assert all(m.attention_function is fn for m in modules)
    assert install_attention_wrappers(model, object()) > 0  # the wrappers only hold their state
    wrapped = model.transformer_blocks[0].attn1.attention_function
    assert wrapped is not fn and wrapped.inner is fn
    remove_attention_wrappers(model)
    assert model.transformer_blocks[0].attn1.attention_function is fn


def test_the_loader_builds_with_sdpa_then_installs_ours(tiny_ltx_23):
    model = load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32", attention_type=TRITON_8BIT))
    fns = [m.attention_function for m in model.transformer.modules() if isinstance(m, Attention)]
    assert fns and all(isinstance(f, TritonAttention) for f in fns)
    assert model.plan.attention_type == TRITON_8BIT and model.config["transformer"]["attention_type"] == "pytorch"
    plain = load_ltx_model(TransformerPlan(tiny_ltx_23, dtype="fp32", attention_type="pytorch"))
    assert graph_key(plain.transformer, "cpu") != graph_key(plain.transformer, "cpu", attention=TRITON_8BIT)


@pytest.mark.parametrize("tq, tk, d", [(77, 300, 64), (300, 1024, 128)])
def test_the_emulated_rounding_backs_the_chosen_formats(tq, tk, d):
    """The kernel's rounding emulated in float32 (``kernel.reference``) against exact attention:
    int8 scores round less than e4m3 ones at the same 8 bits, e4m3 P V adds less than the
    scores' own rounding, and the default (int8 / e4m3) stays within 5 % of the output."""
    q, k, v = _qkv(tq=tq, tk=tk, d=d)
    exact = PytorchAttention()(q, k, v, 4)
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    err = {(qk, pv): _rel(kernel.reference(qb, kb, vb, 4, qk=qk, pv=pv), exact)
           for qk in kernel.QK_FORMATS for pv in kernel.PV_FORMATS}
    bf16 = _rel(PytorchAttention()(qb, kb, vb, 4), exact)
    assert bf16 < err["int8", "16bit"] < err["int8", "e4m3"] < 0.05
    assert err["int8", "e4m3"] < err["e4m3", "16bit"] < err["e4m3", "e4m3"]
    assert 2 * err["int8", "16bit"] < err["e4m3", "16bit"]


def test_an_enum_attention_function_becomes_the_same_call_without_a_graph_break():
    """``traceable``: ltx-core's ``AttentionFunction`` member as a call Dynamo traces whole
    (``fullgraph=True``; a break in torch 2.9's Dynamo otherwise), equal to the member's call;
    other functions unchanged."""
    q, k, v = _qkv(tq=9, tk=12, heads=4, d=16)
    fn = traceable(AttentionFunction.PYTORCH)
    want = AttentionFunction.PYTORCH(q, k, v, 4)
    assert torch.equal(fn(q, k, v, 4), want)
    got = torch.compile(lambda a, b, c: fn(a, b, c, 4), fullgraph=True, backend="eager")(q, k, v)
    assert torch.equal(got, want)
    triton = TritonAttention()
    assert traceable(triton) is triton
