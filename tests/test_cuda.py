"""GPU-only paths, run on a CUDA machine (skipped, with the reason, without one): the pipelined
projection + pinned host copy, the host embedding table, the NF4 loader's defaults (host
embeddings + layer-wise dequant) against bitsandbytes' own path, CUDA graphs, the model path and
FP8 on GPU pools, the 8-bit Triton attention (its numerics against float32 attention, a pool
loading it), and the packed-weight kernels (GGML and e4m3) against gguf's own values."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from pool_support import cleanup, short_dir

from ltx_mgpu.assets import tiny_gemma_dir, tiny_ltx_checkpoint
from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.text.config import TextEncoderConfig
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.encoder.prompt import NonFiniteEmbeddingError, PromptEncoder
from ltx_mgpu.text.features import load_projection
from ltx_mgpu.text.gemma.forward import HostEmbedding, run_tower
from ltx_mgpu.text.gemma.tokenizer import tokenize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)")
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")

PROMPTS = ["a cat", "A red fox running through fresh snow at dawn, cinematic, slow motion.", "x", "two words here"]


def test_pipelined_rows_equal_the_projection_of_the_whole_batch():
    tower = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", dtype=torch.bfloat16)
    proj = load_projection(tiny_ltx_checkpoint("2.3"), device="cuda", dtype=torch.bfloat16,
                           num_layers=tower.num_hidden_states)
    enc = PromptEncoder(tower, proj)
    enc.PIPELINE_TOKENS = 1  # one row per group: the most pipelining
    ids, mask, _ = tokenize(tower, PROMPTS)
    rows = enc.encode_tokens(ids, mask)
    out = run_tower(tower, ids, mask)
    whole = proj(out.hidden_states, out.attention_mask).float().cpu()
    m = whole.shape[1]
    for j, (e, n) in enumerate(zip(rows, mask.sum(1).tolist())):
        assert e.tensor.dtype == torch.float32 and e.tensor.device.type == "cpu" and e.num_tokens == n
        torch.testing.assert_close(e.tensor, whole[j, m - n:], rtol=0.02, atol=0.02)
    assert not torch.equal(rows[0].tensor[-1], rows[1].tensor[-1])


def test_a_non_finite_row_is_found_on_the_gpu_in_its_group():
    """The finite check runs on the GPU, one flag per row copied with the rows: with one row per
    pipelined group, an infinite token embedding in the last prompt is named as that prompt's, and
    the tower restored, the same batch encodes."""
    tower = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", dtype=torch.bfloat16)
    proj = load_projection(tiny_ltx_checkpoint("2.3"), device="cuda", dtype=torch.bfloat16,
                           num_layers=tower.num_hidden_states)
    enc = PromptEncoder(tower, proj)
    enc.PIPELINE_TOKENS = 1
    prompts = ["a cat", "two cats", "x", "rain"]
    rain = tower.tokenizer("rain", add_special_tokens=False)["input_ids"][-1]
    weight = tower.model.get_input_embeddings().weight
    with torch.no_grad():
        saved = weight[rain].clone()
        weight[rain] = float("inf")
    with pytest.raises(NonFiniteEmbeddingError, match=r"prompt 3 \('rain'\): its embedding holds NaN or infinite"):
        enc.encode(prompts, batch_size=4)
    with torch.no_grad():
        weight[rain] = saved
    rows = enc.encode(prompts, batch_size=4)
    assert all(bool(torch.isfinite(r.tensor).all()) for r in rows)


def test_host_embedding_on_cuda_is_bit_identical():
    tower = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", dtype=torch.bfloat16)
    emb = tower.model.get_input_embeddings()
    host = HostEmbedding(emb, torch.device("cuda"))
    assert host.weight.device.type == "cpu"
    for ids in (torch.tensor([[2, 7, 9, 11], [0, 0, 2, 5]]), torch.randint(0, 500, (3, 40))):
        got = host(ids)
        assert got.device.type == "cuda" and torch.equal(got, emb(ids.cuda()))


@needs_bnb
def test_nf4_loader_defaults_equal_bitsandbytes_path(tmp_path):
    default = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", weights="nf4")
    plain = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", weights="nf4", host_embeddings=False,
                                  layer_dequant=False)
    assert isinstance(default.model.get_input_embeddings(), HostEmbedding)
    assert not isinstance(plain.model.get_input_embeddings(), HostEmbedding)
    assert default.device.type == "cuda"
    ids, mask, _ = tokenize(default, PROMPTS)
    a = run_tower(default, ids, mask).hidden_states
    b = run_tower(plain, ids, mask).hidden_states
    assert torch.equal(a[0], b[0])  # the embedding lookup is bit-identical
    keep = mask.bool().cuda()
    for x, y in zip(a[1:], b[1:]):
        torch.testing.assert_close(x[keep].float(), y[keep].float(), rtol=0.02, atol=0.05)
    # the artifact saved from the default tower loads and gives the same hidden states
    from ltx_mgpu.text.nf4.quantize import save_nf4

    save_nf4(default, tmp_path / "nf4")
    again = load_gemma_text_tower(tmp_path / "nf4", device="cuda")
    c = run_tower(again, ids, mask).hidden_states
    for x, y in zip(a, c):
        assert torch.equal(x[keep], y[keep])


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def _nf4(shape, seed=0):
    """A double-quantized NF4 ``Params4bit`` of random weights (a few extreme values) and its
    bitsandbytes dequantization."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf

    torch.manual_seed(seed)
    w = (torch.randn(shape, device="cuda") * 0.02).to(torch.bfloat16)
    w[0, :5] = torch.tensor([0.0, 1e-8, -3.0, 2.5, 65504.0])[:shape[1]]  # zero, tiny, large
    packed, qs = bf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    param = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=qs, blocksize=64, compress_statistics=True,
                              quant_type="nf4", bnb_quantized=True)
    return param, bf.dequantize_4bit(packed, qs)


@needs_bnb
@needs_triton
@pytest.mark.parametrize("shape", [(64, 64), (3840, 4096), (15360, 3840), (8, 96)])
def test_triton_nf4_dequant_is_bit_identical_to_bitsandbytes(shape):
    from ltx_mgpu.text.nf4.dequant import dequantize_nf4

    param, ref = _nf4(shape)
    assert torch.equal(dequantize_nf4(param, method="triton"), ref)


@needs_bnb
@needs_triton
@pytest.mark.parametrize("blocks, warps", [(32, 4), (8, 2), (128, 8)])
def test_triton_unit_dequant_fills_every_weight_of_a_unit_in_one_launch(blocks, warps):
    """Weights of different sizes (one with a nested-block count that is not a multiple of 256)
    into views of one buffer, as FastDequant lays out a decoder layer; every launch setting
    gives the same bytes."""
    from ltx_mgpu.text.nf4.kernel import UnitDequant

    shapes = [(256, 512), (8, 96), (1024, 384), (64, 64)]
    pairs = [_nf4(s, seed=i) for i, s in enumerate(shapes)]
    total = sum(a * b for a, b in shapes)
    buf = torch.full((total + 7,), float("nan"), dtype=torch.bfloat16, device="cuda")
    views, at = [], 0
    for a, b in shapes:
        views.append(buf[at:at + a * b])
        at += a * b
    launch = UnitDequant([p for p, _ in pairs], views, blocks=blocks, num_warps=warps)
    launch()
    for view, (_, ref), shape in zip(views, pairs, shapes):
        assert torch.equal(view.view(shape), ref)
    assert torch.isnan(buf[total:]).all()  # nothing written past the last weight
    with pytest.raises(ValueError, match="contiguous bf16 tensor of 131072 elements"):
        UnitDequant([pairs[0][0]], [views[0][:64]])


@needs_bnb
@needs_triton
def test_loader_default_triton_layer_dequant_equals_bitsandbytes_layer_dequant():
    from ltx_mgpu.text.nf4.dequant import FastDequant

    default = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", weights="nf4")
    bnb_layers = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", weights="nf4", layer_dequant=False)
    FastDequant(bnb_layers.model, method="bnb", scope="layer")
    assert default.model.layers[0].self_attn.q_proj._refs[1].method == "triton"
    ids, mask, _ = tokenize(default, PROMPTS)
    for x, y in zip(run_tower(default, ids, mask).hidden_states, run_tower(bnb_layers, ids, mask).hidden_states):
        assert torch.equal(x, y)


def test_a_compiled_spec_on_cuda_encodes_as_the_eager_one_to_bf16_rounding():
    """TextEncoderConfig(compile=True) on a GPU in bf16 (Inductor's Triton kernels): the embeddings of
    two batch lengths equal the eager ones within bf16 tolerance."""
    from ltx_mgpu.text.encoder.local import LocalTextEncoder

    gemma, ckpt = tiny_gemma_dir(), tiny_ltx_checkpoint("2.3")
    eager = LocalTextEncoder(TextEncoderConfig(gemma, ckpt), "cuda").build()
    compiled = LocalTextEncoder(TextEncoderConfig(gemma, ckpt, compile=True), "cuda").build()
    for batch in (PROMPTS, PROMPTS[1:3]):
        for c, e in zip(compiled.encode(batch), eager.encode(batch)):
            torch.testing.assert_close(c.tensor, e.tensor, rtol=3e-2, atol=3e-2)


def test_the_compiled_layers_on_cuda_run_whole_graphs():
    """Regional compilation on this machine's torch and transformers, on a GPU: no graph break, and
    every decoder layer of every encode runs as one compiled graph (a break inside a layer, as
    transformers' hidden-state capture made before d4dd1e2, splits each layer in three). The
    backend records the graphs Dynamo hands it and counts their calls."""
    from torch._dynamo.utils import counters

    from ltx_mgpu.text.gemma.forward import compile_text_tower

    calls: list[int] = []

    def counting(gm, example_inputs):
        calls.append(0)
        i = len(calls) - 1

        def run(*args):
            calls[i] += 1
            return gm.forward(*args)
        return run

    tower = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", dtype=torch.bfloat16)
    proj = load_projection(tiny_ltx_checkpoint("2.3"), device="cuda", dtype=torch.bfloat16,
                           num_layers=tower.num_hidden_states)
    enc = PromptEncoder(compile_text_tower(tower, "layers", backend=counting, dynamic=False), proj)
    breaks = sum(counters["graph_break"].values())
    layers = tower.config.num_hidden_layers
    for batch in (PROMPTS[:1], PROMPTS):
        enc.encode(batch)
        before = sum(calls)
        enc.encode(batch)
        assert sum(calls) - before == layers, (sum(calls) - before, layers)
    assert sum(counters["graph_break"].values()) == breaks, dict(counters["graph_break"])


# --------------------------------------------------------------------------- CUDA graphs (ltx_mgpu.text.gemma.graphs)

#: within the tiny Gemma's 16-token sliding window (graphs are taken only up to the window)
GRAPH_PROMPTS = ["a cat", "a red fox", "x", "two words"]


def _graph_encoders(tower):
    from ltx_mgpu.text.gemma.graphs import TowerGraphs

    proj = load_projection(tiny_ltx_checkpoint("2.3"), device="cuda", dtype=torch.bfloat16,
                           num_layers=tower.num_hidden_states)
    eager = PromptEncoder(tower, proj, cuda_graphs=False)
    graphed = PromptEncoder(tower, proj, cuda_graphs=False)
    graphed.graphs = TowerGraphs(tower, bucket=4, max_tokens=64)
    return eager, graphed


def _check_graph_replay(tower):
    from ltx_mgpu.text.gemma.graphs import TowerGraphs

    eager, graphed = _graph_encoders(tower)
    stand_in = TowerGraphs(tower, bucket=4, max_tokens=64, capture=False)
    first = {}
    # alternating shapes: every graph shares one pool and one hidden-state buffer
    for prompts in (["a red fox"], ["a cat"], GRAPH_PROMPTS, ["a red fox"], GRAPH_PROMPTS, ["a cat"]):
        ids, mask, _ = tokenize(tower, prompts)
        got = graphed.graphs.run(ids, mask)
        assert got is not None, graphed.graphs.disabled
        states = [s.clone() for s in got.hidden_states]
        key = tuple(prompts)
        if key in first:  # a replay after other graphs ran gives the same bits
            assert all(torch.equal(a, b) for a, b in zip(states, first[key]))
        first[key] = states
        want = stand_in.run(ids, mask)  # the same forward on the same buffers, not captured
        keep = got.attention_mask.bool().cuda()
        for a, b in zip(states, want.hidden_states):
            torch.testing.assert_close(a[keep], b[keep], rtol=0.02, atol=0.02)
    assert graphed.graphs.disabled is None and len(graphed.graphs.shapes) == 3
    for batch in (1, 8):
        for e, g in zip(eager.encode(GRAPH_PROMPTS, batch_size=batch), graphed.encode(GRAPH_PROMPTS, batch_size=batch)):
            torch.testing.assert_close(g.tensor, e.tensor, rtol=0.02, atol=0.02)


def test_cuda_graph_replay_equals_the_eager_forward_bf16():
    tower = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", dtype=torch.bfloat16)
    _check_graph_replay(tower)


@needs_bnb
def test_cuda_graph_replay_equals_the_eager_forward_nf4_with_prefetch():
    """The loader's NF4 tower: the Triton unit dequant with its side-stream prefetch is captured."""
    from ltx_mgpu.text.nf4.dequant import _DenseLinear

    tower = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", weights="nf4")
    dense = [m for m in tower.model.modules() if isinstance(m, _DenseLinear)]
    assert dense and dense[0]._refs[1].prefetch and dense[0]._refs[1].method == "triton"
    _check_graph_replay(tower)


def test_a_12b_shaped_width_is_graphed_by_default():
    """The defaults graph a one-prompt batch of the 12B's 1024 tokens (window 1024)."""
    from ltx_mgpu.text.gemma.graphs import BUCKET, MAX_TOKENS

    tower = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", dtype=torch.bfloat16)
    proj = load_projection(tiny_ltx_checkpoint("2.3"), device="cuda", dtype=torch.bfloat16,
                           num_layers=tower.num_hidden_states)
    enc = PromptEncoder(tower, proj)
    assert enc.graphs is not None and enc.graphs.width(1000) == 1024 and BUCKET == 64 and MAX_TOKENS == 1024


def test_a_failed_capture_falls_back_to_eager_on_the_callers_stream():
    """A forward that cannot be captured (here: a host sync inside it) disables the graphs with
    the first error as the reason, leaves the caller's stream current, and encodes eagerly; the
    device's random generator works afterwards (a failed capture left it marked as capturing, and
    the fp8 tests later in this file, which draw random numbers while compiling, failed)."""
    tower = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", dtype=torch.bfloat16)
    eager, graphed = _graph_encoders(tower)
    runner = graphed.graphs
    original = runner._forward

    def syncing(g):
        original(g)
        torch.ones(1, device="cuda").item()  # a host sync: not allowed while capturing

    runner._forward = syncing
    before = torch.cuda.current_stream()
    ids, mask, _ = tokenize(tower, ["a cat"])
    assert runner.run(ids, mask) is None
    assert runner.disabled and runner.shapes == [] and torch.cuda.current_stream() == before
    for e, g in zip(eager.encode(GRAPH_PROMPTS), graphed.encode(GRAPH_PROMPTS)):
        torch.testing.assert_close(g.tensor, e.tensor, rtol=0.02, atol=0.02)
    assert torch.randn(4, device="cuda").isfinite().all()  # the generator is out of its capture state


def test_the_model_path_on_a_gpu_pool_equals_the_call_in_process():
    """ComfyUI's tensors on the GPU (as its sampler holds them) through a one-GPU pool's
    ``forward`` give the in-process ``comfy_forward`` of the same checkpoint on that GPU."""
    from ltx_mgpu.client.denoise import remote_load_transformer
    from ltx_mgpu.client.model import PoolModel
    from ltx_mgpu.client.pool_client import PoolClient
    from ltx_mgpu.denoise.comfyui.forward import comfy_forward, processed_context
    from ltx_mgpu.denoise.model import load_ltx_model

    ckpt = tiny_ltx_checkpoint("2.3")
    local = load_ltx_model(TransformerPlan(ckpt, dtype="fp32"), "cuda")
    g = torch.Generator().manual_seed(3)
    x = [torch.randn(2, 128, 3, 3, 5, generator=g).cuda(), torch.randn(2, 8, 7, 16, generator=g).cuda()]
    t = (torch.full((2,), 0.7, device="cuda"), torch.full((2,), 0.7, device="cuda"))
    text = torch.randn(2, 9, 48, generator=g).cuda()
    with torch.no_grad():
        ctx = processed_context(local, text, True)
        want = comfy_forward(local, local.transformer, x, t, ctx)
    base = short_dir()
    client = PoolClient.connect(gpus="0", runtime_dir=base, lifetime="with-owner", startup_timeout=300)
    try:
        loaded = remote_load_transformer(client, TransformerPlan(str(ckpt), dtype="fp32"), timeout=300)
        pm = PoolModel(lambda: client, lambda: None, loaded["model"], key=loaded["key"])
        got_ctx = pm.text_contexts(text, True)
        got = pm.forward(x, t, got_ctx)
    finally:
        client.shutdown()
        cleanup(base)
    assert got_ctx.device.type == "cuda" and (got_ctx - ctx).abs().max().item() <= 1e-5
    assert all(g.device.type == "cuda" for g in got)
    assert max((a - b).abs().max().item() for a, b in zip(got, want, strict=True)) <= 1e-4


def test_compile_on_runs_bf16_blocks_compiled_in_a_gpu_pool_near_the_eager_call():
    """Model Loader ``compile: on`` in bf16 on a one-GPU pool: the load says the blocks are
    compiled, and two calls (the first compiles) are within bf16 rounding of the eager bf16 call in
    process, and of each other exactly (one graph)."""
    from ltx_mgpu.client.denoise import remote_load_transformer
    from ltx_mgpu.client.model import PoolModel
    from ltx_mgpu.client.pool_client import PoolClient
    from ltx_mgpu.denoise.comfyui.forward import comfy_forward, processed_context
    from ltx_mgpu.denoise.model import load_ltx_model

    ckpt = tiny_ltx_checkpoint("2.3")
    local = load_ltx_model(TransformerPlan(ckpt, dtype="bf16"), "cuda")
    g = torch.Generator().manual_seed(3)
    x = [torch.randn(2, 128, 3, 3, 5, generator=g).cuda().bfloat16(), torch.randn(2, 8, 7, 16, generator=g).cuda()
         .bfloat16()]
    t = (torch.full((2,), 0.7, device="cuda"), torch.full((2,), 0.7, device="cuda"))
    text = torch.randn(2, 9, 48, generator=g).cuda().bfloat16()
    with torch.no_grad():
        ctx = processed_context(local, text, True)
        want = comfy_forward(local, local.velocity_model(), x, t, ctx)
    base = short_dir()
    client = PoolClient.connect(gpus="0", runtime_dir=base, lifetime="with-owner", startup_timeout=300)
    try:
        plan = TransformerPlan(str(ckpt), dtype="bf16", compile="on")
        loaded = remote_load_transformer(client, plan, timeout=300)
        pm = PoolModel(lambda: client, lambda: None, loaded["model"], key=loaded["key"])
        first, second = (pm.forward(x, t, ctx) for _ in range(2))
    finally:
        client.shutdown()
        cleanup(base)
    assert loaded["plan"]["compiled"] is True, loaded["plan"]
    for a, b, w in zip(first, second, want, strict=True):
        assert torch.equal(a, b)
        assert ((a.float() - w.float()).norm() / w.float().norm()).item() <= 2e-2


def test_guides_reference_audio_and_sharded_weights_on_a_gpu_pool_equal_the_call_in_process():
    """On a one-GPU pool: a call with two keyframe guides (strength 0.7: the guide attention
    mask through cuDNN / efficient SDPA), dropped guide tokens and reference audio equals the
    in-process call, for the replicated and the FSDP-sharded load (world size 1)."""
    from ltx_mgpu.client.denoise import remote_load_transformer
    from ltx_mgpu.client.model import PoolModel
    from ltx_mgpu.client.pool_client import PoolClient
    from ltx_mgpu.denoise.comfyui.extra_conds import extra_conds, grid_mask
    from ltx_mgpu.denoise.comfyui.forward import comfy_forward, processed_context
    from ltx_mgpu.denoise.model import load_ltx_model

    ckpt = tiny_ltx_checkpoint("2.3")
    local = load_ltx_model(TransformerPlan(ckpt, dtype="fp32"), "cuda")
    g = torch.Generator().manual_seed(5)
    x = [torch.randn(2, 128, 4, 3, 5, generator=g).cuda(), torch.randn(2, 8, 7, 16, generator=g).cuda()]
    mask = torch.ones(2, 1, 4, 3, 5)
    mask[:, :, 2], mask[:, :, 3] = 0.0, 0.3
    mask[:, :, 3, 0] = -1.0
    hh, ww = torch.meshgrid(torch.arange(3) * 32.0, torch.arange(5) * 32.0, indexing="ij")
    coords = [torch.stack([torch.full((3, 5), float(f)), hh, ww]).reshape(3, -1) for f in (0, 8)]
    kf = torch.cat([torch.stack([c, c + torch.tensor([1.0, 32.0, 32.0]).view(3, 1)], -1) for c in coords], 1)
    kf = kf.unsqueeze(0).expand(2, -1, -1, -1).contiguous()
    entries = [{"pre_filter_count": 15, "strength": s, "pixel_mask": None, "latent_shape": [1, 3, 5]}
               for s in (1.0, 0.7)]
    ref = {"tokens": torch.randn(1, 4, 128, generator=g)}
    t_v = (mask * 0.6).permute(0, 2, 3, 4, 1).reshape(2, -1, 1).cuda()
    t = (t_v, torch.full((2,), 0.6, device="cuda"))
    text = torch.randn(2, 9, 48, generator=g).cuda()
    kwargs = {"denoise_mask": mask.expand(-1, 128, -1, -1, -1).cuda(), "keyframe_idxs": kf,
              "guide_attention_entries": entries, "ref_audio": ref}
    conds = extra_conds(keyframe_idxs=kf, keep=grid_mask(mask), guide_attention_entries=entries, ref_audio=ref)
    with torch.no_grad():
        ctx = processed_context(local, text, True)
        want = comfy_forward(local, local.transformer, x, t, ctx, conds=conds)
    base = short_dir()
    client = PoolClient.connect(gpus="0", runtime_dir=base, lifetime="with-owner", startup_timeout=300)
    try:
        got = {}
        for weights in ("replicated", "sharded"):
            loaded = remote_load_transformer(client, TransformerPlan(str(ckpt), dtype="fp32", weights=weights),
                                             name=weights, timeout=300)
            pm = PoolModel(lambda: client, lambda: None, loaded["model"], key=loaded["key"])
            got[weights] = pm.forward(x, t, ctx, conds=kwargs)
    finally:
        client.shutdown()
        cleanup(base)
    for weights, out in got.items():
        assert max((a - b).abs().max().item() for a, b in zip(out, want, strict=True)) <= 1e-4, weights


def _fp8_sized_checkpoint(tmp_dir, video_head_dim: int = 64) -> str:
    """A 2-block LTX-2.3-layout transformer-only file whose block linears FP8 compute takes
    (video and audio 4 heads x 64: 256 wide, feed-forwards 1,024; or video heads of
    ``video_head_dim``), random weights, float32."""
    import json

    from safetensors.torch import save_file
    from sp_harness import build_tiny_model, tiny_config

    sizes = dict(attention_head_dim=video_head_dim, cross_attention_dim=4 * video_head_dim, audio_attention_head_dim=64,
                 audio_cross_attention_dim=256)
    model = build_tiny_model(**sizes)
    path = f"{tmp_dir}/fp8_sized_{video_head_dim}.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path,
              metadata={"config": json.dumps(tiny_config(**sizes))})
    return path


def _fp8_inputs():
    g = torch.Generator().manual_seed(7)
    x = [torch.randn(2, 128, 3, 4, 6, generator=g).cuda().bfloat16(),
         torch.randn(2, 8, 7, 16, generator=g).cuda().bfloat16()]
    t = (torch.full((2,), 0.7, device="cuda"), torch.full((2,), 0.7, device="cuda"))
    ctx = torch.randn(2, 12, 512, generator=g).cuda().bfloat16()
    return x, t, ctx


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp8_compute_runs_every_block_linear_as_an_e4m3_gemm_within_its_rounding(tmp_path):
    """``fp8_compute``: the block linears become compiled e4m3 GEMMs; the velocity stays within
    e4m3's rounding of the bf16 model's (same weights), and one compiled graph serves all blocks."""
    import torch._dynamo.utils as dynamo_utils

    from ltx_mgpu.denoise.comfyui.forward import comfy_forward
    from ltx_mgpu.denoise.fp8 import Float8Linear
    from ltx_mgpu.denoise.model import load_ltx_model

    ckpt = _fp8_sized_checkpoint(tmp_path)
    bf16 = load_ltx_model(TransformerPlan(ckpt), "cuda")
    fp8 = load_ltx_model(TransformerPlan(ckpt, dtype="fp8"), "cuda")
    layers = [m for m in fp8.transformer.modules() if isinstance(m, Float8Linear)]
    assert fp8.linears == "fp8" and len(layers) == sum(1 for n, m in bf16.transformer.named_modules()
                                                    if n.startswith("transformer_blocks.")
                                                    and isinstance(m, torch.nn.Linear) and min(m.weight.shape) >= 256)
    x, t, ctx = _fp8_inputs()
    with torch.no_grad():
        want = comfy_forward(bf16, bf16.transformer, x, t, ctx)
        got = comfy_forward(fp8, fp8.transformer, x, t, ctx)
        graphs = dynamo_utils.counters["stats"]["unique_graphs"]
        again = comfy_forward(fp8, fp8.transformer, x, t, ctx)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs  # the same size: no recompile
    for a, b, c in zip(got, want, again, strict=True):
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all()
        assert 0 < _rel(a, b) < 0.1, _rel(a, b)
        assert torch.equal(a, c)


def test_fp8_calls_padded_to_a_token_bucket_share_a_graph_on_the_flash_kernel(tmp_path):
    """``dtype: fp8`` through ``velocity_model`` (as the pool calls it, the product's token buckets):
    72 and 75 video tokens both run as the bucket of 128, one compiled graph for both (Dynamo's
    counters); the two attentions that see the padded video run on SDPA's flash kernel alone
    (which takes no mask: the padded keys are left out, not masked).

    Exactness of the padding is shown in fp32, where nothing rounds it away: the padded call
    equals the unpadded one to 1e-4 on the GPU's kernels. In fp8 the padded and unpadded calls
    run different kernels (other GEMM tiles at another row count), and e4m3 re-rounds their
    bf16-level differences into percents (``benchmarks/results/notes.md``, "fp8 and token
    buckets"), so there each is held to the fp8 error of the unpadded call against the bf16
    model: no more than 1.25 times it."""
    import dataclasses

    import torch._dynamo.utils as dynamo_utils
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ltx_mgpu.denoise.comfyui.forward import comfy_forward
    from ltx_mgpu.denoise.model import load_ltx_model

    ckpt = _fp8_sized_checkpoint(tmp_path)
    fp8 = load_ltx_model(TransformerPlan(ckpt, dtype="fp8"), "cuda")
    assert fp8.buckets is not None and fp8.buckets.padded(72) == fp8.buckets.padded(75) == 128
    x, t, ctx = _fp8_inputs()
    g = torch.Generator().manual_seed(9)
    inputs = [x, [torch.randn(2, 128, 3, 5, 5, generator=g).cuda().bfloat16(), x[1]]]
    fp32 = load_ltx_model(TransformerPlan(ckpt, dtype="fp32"), "cuda")
    bucketed = dataclasses.replace(fp32, buckets=fp8.buckets)  # eager blocks, padded as the fp8 model pads
    bf16 = load_ltx_model(TransformerPlan(ckpt), "cuda")
    with torch.no_grad():
        for xs in inputs:
            xs32 = [a.float() for a in xs]
            plain = comfy_forward(fp32, fp32.transformer, xs32, t, ctx.float())
            padded = comfy_forward(bucketed, bucketed.velocity_model(), xs32, t, ctx.float())
            for a, b in zip(padded, plain, strict=True):
                assert _rel(a, b) <= 1e-4, _rel(a, b)
        del fp32, bucketed
        ref = [comfy_forward(bf16, bf16.transformer, xs, t, ctx) for xs in inputs]
        want = [comfy_forward(fp8, fp8.transformer, xs, t, ctx) for xs in inputs]  # unpadded, own graphs
    velocity = fp8.velocity_model()
    flash_calls = []
    for block in fp8.transformer.transformer_blocks:
        for name in ("attn1", "video_to_audio_attn"):
            wrapper = getattr(block, name).attention_function

            def on_flash(q, k, v, heads, mask=None, _inner=wrapper.inner):
                flash_calls.append((q.shape[1], k.shape[1], mask))
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    return _inner(q, k, v, heads, mask)

            wrapper.inner = on_flash
    graphs = []
    with torch.no_grad():
        for xs, w, r in zip(inputs, want, ref, strict=True):
            got = comfy_forward(fp8, velocity, xs, t, ctx)
            graphs.append(dynamo_utils.counters["stats"]["unique_graphs"])
            for a, b, c in zip(got, w, r, strict=True):
                assert a.shape == b.shape and torch.isfinite(a).all()
                assert _rel(a, c) <= 1.25 * _rel(b, c), (_rel(a, c), _rel(b, c))
    assert graphs[1] == graphs[0]  # 75 tokens ran the graph 72 tokens compiled
    assert {(q, m) for q, _, m in flash_calls} >= {(128, None)} and all(m is None for _, _, m in flash_calls)
    assert {k for _, k, _ in flash_calls} == {72, 75}


def test_fp8_compute_on_a_gpu_pool_replicated_sharded_and_patched(tmp_path):
    """``dtype: fp8`` through a one-GPU pool's MODEL path equals the in-process fp8 model called as
    the pool calls it (``velocity_model``: padded to the token bucket, so the same compiled
    kernels), also with FSDP2-sharded weights (world size 1, the compiled blocks inside FSDP's
    hooks); a ComfyUI
    LoRA patch changes the result and removing it restores the unpatched one; a skipped block
    (skip-layer guidance) equals the in-process skip and gives the compiled block back."""
    from ltx_mgpu.client.denoise import remote_load_transformer
    from ltx_mgpu.client.model import PoolModel
    from ltx_mgpu.client.pool_client import PoolClient
    from ltx_mgpu.denoise.comfyui.forward import comfy_forward
    from ltx_mgpu.denoise.comfyui.skip_blocks import skipped_blocks
    from ltx_mgpu.denoise.model import load_ltx_model

    ckpt = _fp8_sized_checkpoint(tmp_path)
    local = load_ltx_model(TransformerPlan(ckpt, dtype="fp8"), "cuda")
    x, t, ctx = _fp8_inputs()
    with torch.no_grad():
        want = comfy_forward(local, local.velocity_model(), x, t, ctx)
        with skipped_blocks(local.transformer, [0]):
            want_skipped = comfy_forward(local, local.velocity_model(), x, t, ctx)
    g = torch.Generator().manual_seed(8)

    class Lora:
        name, weights = "lora", (torch.randn(256, 2, generator=g), torch.randn(2, 256, generator=g), None, None,
                                 None, None)

    patches = ("p1", {"diffusion_model.transformer_blocks.0.attn1.to_q.weight": [(0.5, Lora(), 1.0, None, None)]})
    base = short_dir()
    client = PoolClient.connect(gpus="0", runtime_dir=base, lifetime="with-owner", startup_timeout=300)
    try:
        got = {}
        for weights in ("replicated", "sharded"):
            loaded = remote_load_transformer(client, TransformerPlan(ckpt, dtype="fp8", weights=weights),
                                             name=weights, timeout=300)
            assert loaded["plan"]["linears"] == "fp8" and loaded["plan"]["dtype"] == "fp8"
            pm = PoolModel(lambda: client, lambda: None, loaded["model"], key=loaded["key"])
            plain = pm.forward(x, t, ctx)
            patched = pm.forward(x, t, ctx, patches=patches)
            pm.sync_patches("none", {})
            restored = pm.forward(x, t, ctx)
            skipped = pm.forward(x, t, ctx, skip_blocks=[0])
            got[weights] = (plain, patched, restored, skipped, pm.forward(x, t, ctx))
    finally:
        client.shutdown()
        cleanup(base)
    for weights, (plain, patched, restored, skipped, after) in got.items():
        for a, b in zip(plain, want, strict=True):
            assert _rel(a, b) <= 1e-2, (weights, _rel(a, b))
        for a, b in zip(skipped, want_skipped, strict=True):
            assert _rel(a, b) <= 1e-2, (weights, "skipped", _rel(a, b))
        assert _rel(patched[0], plain[0]) > 1e-3 and _rel(skipped[0], plain[0]) > 1e-3
        assert all(torch.equal(a, b) for a, b in zip(restored, plain))
        assert all(torch.equal(a, b) for a, b in zip(after, plain))  # the compiled block is back


def test_one_gpu_pool_encodes_with_cuda_graphs_then_samples_with_fp8(tmp_path):
    """The pool as ``generate`` uses it, in one worker process: prompts encoded by the graphed
    bf16 Gemma (CUDA graphs captured and replayed), then the transformer loaded with ``dtype:
    fp8`` (compiled e4m3 blocks) and a latent sampled. The sample equals the in-process fp8
    sampler's (the same compiled kernels) and the embeddings the in-process graphed encoder's."""
    from ltx_mgpu.client.denoise import SampleRequest, remote_load_transformer, remote_sample
    from ltx_mgpu.client.pool_client import PoolClient
    from ltx_mgpu.client.text import encode_prompts
    from ltx_mgpu.denoise.comfyui.sampler import sample
    from ltx_mgpu.denoise.model import load_ltx_model
    from ltx_mgpu.nested import NestedTensorLike

    encoder = TextEncoderConfig(tiny_gemma_dir(), tiny_ltx_checkpoint("2.3"), dtype="bfloat16")
    tower = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", dtype=torch.bfloat16)
    proj = load_projection(tiny_ltx_checkpoint("2.3"), device="cuda", dtype=torch.bfloat16,
                           num_layers=tower.num_hidden_states)
    local_encoder = PromptEncoder(tower, proj)
    assert local_encoder.graphs is not None  # the pool's encoder is built the same way: graphed
    want_text = local_encoder.encode(PROMPTS)
    ckpt = _fp8_sized_checkpoint(tmp_path)
    g = torch.Generator().manual_seed(5)
    cond = lambda: [[torch.randn(1, 12, 512, generator=g), {}]]  # noqa: E731 - processed context, this width
    pos, neg = cond(), cond()
    latent = {"samples": NestedTensorLike([torch.randn(1, 128, 3, 4, 6, generator=g),
                                           torch.randn(1, 8, 7, 16, generator=g)]), "type": "audio"}
    sigmas = torch.tensor([1.0, 0.725, 0.421875, 0.0])
    local = load_ltx_model(TransformerPlan(ckpt, dtype="fp8"), "cuda")
    want = sample(local, pos, neg, latent, sigmas=sigmas, cfg=3.0, seed=4)
    del local
    base = short_dir()
    client = PoolClient.connect(gpus="0", runtime_dir=base, lifetime="with-owner", startup_timeout=300)
    try:
        text, _ = encode_prompts(client, encoder, PROMPTS, cache=None)
        loaded = remote_load_transformer(client, TransformerPlan(ckpt, dtype="fp8"), timeout=300)
        assert loaded["plan"]["linears"] == "fp8"
        got = remote_sample(client, SampleRequest(pos, neg, latent, sigmas=sigmas, cfg=3.0, seed=4), timeout=300)
    finally:
        client.shutdown()
        cleanup(base)
    for e, w in zip(text, want_text, strict=True):
        torch.testing.assert_close(e.tensor.float(), w.tensor.float().cpu(), rtol=0.02, atol=0.02)
    for a, b in zip(got["samples"].tensors, want["samples"].tensors, strict=True):
        assert torch.isfinite(a).all() and _rel(a, b.to(a.device)) <= 1e-2, _rel(a, b.to(a.device))


def test_fp8_is_refused_where_torch_cannot_run_the_rowwise_fp8_gemm(monkeypatch):
    """The load-time probe: a GPU whose cuBLAS / CUTLASS lacks the rowwise-scaled e4m3 GEMM is
    refused before loading, naming the fix; this GPU passes it."""
    from ltx_mgpu.denoise.fp8 import fp8_support_error

    device = torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("this GPU has no FP8 tensor cores (the capability check refuses it first)")
    assert fp8_support_error(device) is None

    def unsupported(*args, **kwargs):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")

    monkeypatch.setattr(torch, "_scaled_mm", unsupported)
    msg = fp8_support_error(device)
    assert "cannot run the rowwise-scaled FP8 GEMM" in msg and "CUBLAS_STATUS_NOT_SUPPORTED" in msg
    assert msg.endswith("choose dtype 'bf16'")


# --------------------------------------------------------------------------- the 8-bit Triton attention


def _needs_hopper():
    from ltx_mgpu.denoise.attention.function import support_error

    if (err := support_error(torch.device("cuda", torch.cuda.current_device()))) is not None:
        pytest.skip(err)


def _attention_inputs(b: int, tq: int, tk: int, heads: int, d: int, gain: float = 1.5, seed: int = 0):
    """q and k RMS-normalized times ``gain`` (as after ltx-core's q_norm / k_norm), v standard
    normal, ``[B, T, H*D]`` bf16 on the GPU."""
    g = torch.Generator().manual_seed(seed)

    def normed(t):
        x = torch.randn(b, t, heads, d, generator=g)
        return (gain * x / x.pow(2).mean(-1, keepdim=True).sqrt()).flatten(2)

    return [t.cuda().bfloat16() for t in (normed(tq), normed(tk), torch.randn(b, tk, heads * d, generator=g))]


def _exact_attention(q, k, v, heads):
    from ltx_core.model.transformer.attention import PytorchAttention

    return PytorchAttention()(q.float(), k.float(), v.float(), heads)


@pytest.mark.parametrize("qk, pv", [("int8", "e4m3"), ("int8", "16bit"), ("e4m3", "e4m3"), ("e4m3", "16bit")])
@pytest.mark.parametrize("tq, tk, d, gain", [(1, 1, 64, 1.5), (77, 300, 64, 1.5), (126, 126, 64, 1.5),
                                             (1000, 1000, 128, 1.5), (300, 1024, 128, 1.5), (4096, 4096, 128, 1.5),
                                             (130, 4100, 64, 1.5), (256, 512, 128, 6.0)])
def test_the_8bit_attention_kernel_is_within_its_rounding_of_float32_attention(qk, pv, tq, tk, d, gain):
    """Every format pair, head dims 64 and 128, token counts that are and are not whole blocks,
    self- and cross-attention, a peaked softmax: the kernel's error against float32 attention is
    that of its rounding emulated in float32 (``kernel.reference``), up to the order of its sums
    and P rounded against the running max (a quarter more, plus bf16's output rounding)."""
    from ltx_mgpu.denoise.attention import kernel

    _needs_hopper()
    q, k, v = _attention_inputs(2, tq, tk, 4, d, gain)
    exact = _exact_attention(q, k, v, 4)
    got = kernel.attend(q, k, v, 4, qk=qk, pv=pv)
    emulated = kernel.reference(q, k, v, 4, qk=qk, pv=pv)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape and torch.isfinite(got).all()
    assert _rel(got, exact) <= 1.25 * _rel(emulated, exact) + 5e-3, (_rel(got, exact), _rel(emulated, exact))


def test_the_8bit_attention_reads_strided_views_as_their_copies():
    """q, k, v as the Ulysses exchange and ltx-core hand them over (views of a wider tensor, only
    the last dim contiguous) give the bits their contiguous copies give."""
    from ltx_mgpu.denoise.attention import kernel

    _needs_hopper()
    q, k, v = _attention_inputs(2, 333, 333, 4, 128)
    packed = torch.stack([q, k, v], 2)  # [B, T, 3, H*D]: each a view of stride 3*H*D per token
    views = packed.unbind(2)
    assert not views[0].is_contiguous()
    assert torch.equal(kernel.attend(*views, 4), kernel.attend(q, k, v, 4))


@pytest.mark.parametrize("d", [64, 128])
def test_the_8bit_attention_through_tma_descriptors_equals_its_pointer_loads(d):
    """``Config.tma``: the same tiles read by Hopper's TMA give the pointer loads' result (the
    same products and sums; 1e-3 leaves room for another MMA instruction shape)."""
    from ltx_mgpu.denoise.attention import kernel

    _needs_hopper()
    q, k, v = _attention_inputs(2, 1000, 1000, 4, d)
    cfg = kernel.CONFIGS[d]
    for pv in kernel.PV_FORMATS:
        a = kernel.attend(q, k, v, 4, pv=pv, config=cfg._replace(tma=False))
        b = kernel.attend(q, k, v, 4, pv=pv, config=cfg._replace(tma=True))
        assert _rel(b, a) <= 1e-3, (pv, _rel(b, a))


def test_triton_attention_compiles_into_one_graph_and_a_mask_runs_sdpa():
    """Under ``torch.compile(fullgraph=True)`` the custom op is one opaque call (no graph break)
    with the eager bits; with a mask the call is ltx-core's SDPA's."""
    from ltx_core.model.transformer.attention import PytorchAttention

    from ltx_mgpu.denoise.attention.function import TritonAttention

    _needs_hopper()
    q, k, v = _attention_inputs(2, 500, 500, 4, 64)
    fn = TritonAttention()
    compiled = torch.compile(lambda a, b, c: fn(a, b, c, 4), fullgraph=True)
    eager = fn(q, k, v, 4)
    assert torch.equal(compiled(q, k, v), eager)
    assert _rel(eager, _exact_attention(q, k, v, 4)) < 0.05
    mask = torch.zeros(1, 1, 1, 500, device="cuda", dtype=torch.bfloat16)
    mask[..., 400:] = torch.finfo(torch.bfloat16).min
    assert torch.equal(fn(q, k, v, 4, mask), PytorchAttention()(q, k, v, 4, mask))


def test_a_gpu_pool_loads_triton_8bit_and_its_model_path_equals_the_call_in_process(tmp_path):
    """``attention_type: triton_8bit`` through a one-GPU pool (dtype bf16 and fp8: the compiled
    blocks call the kernel) equals the in-process model of the same plan called as the pool calls
    it (``velocity_model``, padded to the token bucket), stays within the
    kernel's rounding of the SDPA model, and dtype fp32 or a head dim other than 64 and 128 (a
    custom checkpoint's) is refused at load naming the fix."""
    from ltx_mgpu.client.denoise import remote_load_transformer
    from ltx_mgpu.client.errors import BadInputError
    from ltx_mgpu.client.model import PoolModel
    from ltx_mgpu.client.pool_client import PoolClient
    from ltx_mgpu.denoise.comfyui.forward import comfy_forward
    from ltx_mgpu.denoise.model import load_ltx_model

    _needs_hopper()
    ckpt = _fp8_sized_checkpoint(tmp_path)
    x, t, ctx = _fp8_inputs()
    want, sdpa = {}, {}
    with torch.no_grad():
        for dtype in ("bf16", "fp8"):
            local = load_ltx_model(TransformerPlan(ckpt, dtype=dtype, attention_type="triton_8bit"), "cuda")
            want[dtype] = comfy_forward(local, local.velocity_model(), x, t, ctx)  # as the pool calls it
            del local
            plain = load_ltx_model(TransformerPlan(ckpt, dtype=dtype, attention_type="pytorch"), "cuda")
            sdpa[dtype] = comfy_forward(plain, plain.velocity_model(), x, t, ctx)
            del plain
    base = short_dir()
    client = PoolClient.connect(gpus="0", runtime_dir=base, lifetime="with-owner", startup_timeout=300)
    try:
        with pytest.raises(BadInputError, match="attention_type 'triton_8bit' cannot run on cuda.*'pytorch'"):
            remote_load_transformer(client, TransformerPlan(ckpt, dtype="fp32", attention_type="triton_8bit"),
                                    name="fp32", timeout=300)
        # a custom checkpoint's head dim the kernel does not take: refused at load, not in the kernel
        odd = _fp8_sized_checkpoint(tmp_path, video_head_dim=96)
        with pytest.raises(BadInputError, match="'triton_8bit' cannot run on cuda.*head dims \\(64, 128\\), got 96"):
            remote_load_transformer(client, TransformerPlan(odd, dtype="bf16", attention_type="triton_8bit"),
                                    name="d96", timeout=300)
        got = {}
        for dtype in ("bf16", "fp8"):
            loaded = remote_load_transformer(client, TransformerPlan(ckpt, dtype=dtype, attention_type="triton_8bit"),
                                             name=dtype, timeout=300)
            assert loaded["plan"]["attention_type"] == "triton_8bit"
            pm = PoolModel(lambda: client, lambda: None, loaded["model"], key=loaded["key"])
            got[dtype] = pm.forward(x, t, ctx)
            client.request("unload", {"names": [dtype]}, timeout=60)
    finally:
        client.shutdown()
        cleanup(base)
    for dtype in ("bf16", "fp8"):
        for a, b, c in zip(got[dtype], want[dtype], sdpa[dtype], strict=True):
            assert torch.isfinite(a).all() and _rel(a, b) <= 1e-2, (dtype, _rel(a, b))
            assert 0 < _rel(b, c) < 0.1, (dtype, _rel(b, c))


# --------------------------------------------------------------------------- packed GGML and e4m3 kernels


def _blocks_of(qtype: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """``[rows, row bytes]`` uint8 of ``qtype``: ``gguf``'s quantizer where it has one, else random
    K-quant blocks with finite scales (``ltx_mgpu.assets.ggml_export``'s)."""
    import gguf
    import numpy as np

    from ltx_mgpu.assets.ggml_export import QUANTIZABLE, _random_k_blocks

    if qtype in QUANTIZABLE:
        values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
        return torch.from_numpy(gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype]).copy())
    return torch.from_numpy(_random_k_blocks(qtype, (rows, cols), 3.0, f"{qtype}-{seed}"))


@needs_triton
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_ggml_kernels_and_the_torch_path_on_the_gpu_are_bit_equal_to_gguf(qtype):
    import gguf

    from ltx_mgpu.quantized.ggml import dequantize
    from ltx_mgpu.quantized.kernels import dequantize_ggml

    rows, cols = 48, 1024
    data = _blocks_of(qtype, rows, cols)
    want = torch.from_numpy(gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[qtype]).copy())
    gpu = data.cuda()
    assert torch.equal(dequantize(gpu, qtype, (rows, cols)).cpu(), want)  # the torch path, on the GPU
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = dequantize_ggml(gpu, qtype, torch.empty(rows, cols, dtype=dtype, device="cuda"))
        assert torch.equal(out.cpu(), want.to(dtype)), dtype


@needs_triton
def test_the_e4m3_upcast_kernel_is_the_eager_upcast():
    from ltx_mgpu.quantized.kernels import upcast_e4m3

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(300, 1000, device="cuda", generator=g) * 40).to(torch.float8_e4m3fn)
    s = torch.rand(300, device="cuda", generator=g) + 0.1
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(upcast_e4m3(w, s, dtype), (w.float() * s[:, None]).to(dtype))


@needs_triton
def test_a_gguf_transformer_on_the_gpu_equals_its_dequantized_weights(tmp_path):
    """Q4_K, Q8_0 and Q6_K files on the GPU: the packed layers (the kernels' dequant) compute what
    the float32 file of the same values computes (fp32, 1e-5)."""
    from gguf_support import AV_ODD_CASE, gguf_pair, rel, wide_file
    from sp_harness import run_case

    from ltx_mgpu.denoise.model import load_ltx_model
    from ltx_mgpu.quantized.packed import PackedLinear

    for qtype in ("Q4_K", "Q8_0", "Q6_K"):
        gguf_path, reference = gguf_pair(wide_file(tmp_path), tmp_path, qtype)
        packed = load_ltx_model(TransformerPlan(gguf_path, dtype="fp32"), "cuda")
        dense = load_ltx_model(TransformerPlan(reference, dtype="fp32"), "cuda")
        assert any(isinstance(m, PackedLinear) for m in packed.transformer.modules())
        with torch.no_grad():
            got, want = run_case(_on_cuda(packed.transformer), AV_ODD_CASE), run_case(_on_cuda(dense.transformer),
                                                                                      AV_ODD_CASE)
        for a, b in zip(got, want):
            assert rel(a.cpu(), b.cpu()) <= 1e-5, qtype


@needs_triton
@pytest.mark.parametrize("quant, shape", [(("nvfp4", None, False), (4096, 1024)), (("nvfp4", None, True), (130, 200)),
                                          (("mxfp8", None, False), (70, 100)), (("mxfp8", None, False), (1024, 4096)),
                                          (("int8_tensorwise", None, False), (300, 1000)),
                                          (("int8_tensorwise", 256, False), (512, 4096)),
                                          (("int8_tensorwise", 16, False), (70, 48))])
def test_row_kernels_and_the_torch_path_on_the_gpu_equal_comfy_kitchens_values(quant, shape):
    """ComfyUI's nvfp4, mxfp8 and int8 rows (``ltx_mgpu.quantized.rows``): the kernels give comfy-kitchen's
    eager values bit for bit in bf16, fp16 and fp32; int8 with ConvRot its exact rotation, within
    float32's last bits of comfy-kitchen's float32 matmul (and the same bits in the output dtype
    but where that rounding crosses a tie)."""
    from ltx_mgpu.quantized import rows
    from ltx_mgpu.quantized.dequant import dequantize
    from ltx_mgpu.quantized.encode import quantize_layer
    from ltx_mgpu.quantized.layers import LayerQuant
    from ltx_mgpu.quantized.packed import dequantize_rows

    fmt, group, pre = quant
    layer = LayerQuant(fmt, group, pre_quant_scale=pre)
    g = torch.Generator().manual_seed(shape[0])
    parts = quantize_layer(torch.randn(*shape, generator=g) * 0.05, LayerQuant(fmt, group))
    if pre:
        parts["pre_quant_scale"] = torch.rand(shape[1], generator=g) + 0.5
    packed, tensor_scale, column_scale = rows.pack_rows(layer, {k: v.cuda() for k, v in parts.items()}, shape)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        want = dequantize(layer, parts, dtype, shape)  # comfy-kitchen's eager functions on the CPU
        torch_path = rows.dequantize(packed, layer.describe(), shape[1], dtype, tensor_scale, column_scale)
        kernel = dequantize_rows(packed, layer.describe(), shape[1], dtype, (), None, tensor_scale, column_scale)
        if group is None:
            assert torch.equal(torch_path.cpu(), want) and torch.equal(kernel.cpu(), want), dtype
        else:
            # the exact values, in float64: (q @ H) * s / sqrt(g), H the +-1 Hadamard matrix
            q = parts["weight"].double().reshape(shape[0], -1, group)
            h = torch.ones(1, 1, dtype=torch.float64)
            while h.shape[0] < group:
                h = torch.kron(h, torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]],
                                               dtype=torch.float64))
            exact = ((q @ h).reshape(shape) * parts["weight_scale"].double().reshape(-1, 1) / group ** 0.5)
            # the kernel rounds to float32 once, then to the dtype: within its unit roundoff (and float32's)
            bound = (torch.finfo(dtype).eps / 2 + 2.0 ** -24) * exact.abs()
            assert ((kernel.cpu().double() - exact).abs() <= bound).all(), dtype
            if dtype != torch.float32:  # comfy-kitchen's float32 sums, rounded to bf16 / fp16: mostly the same
                assert (kernel.cpu() != want).float().mean() < 0.01, dtype


def test_a_bf16_lora_on_a_packed_weight_adds_what_the_float32_product_adds():
    """``LoraDelta`` with bf16 factors multiplies on the tensor cores into float32: the float32
    product's values, to float32's accumulation rounding; float32 factors take the float32 path."""
    from ltx_mgpu.quantized.packed import LoraDelta

    g = torch.Generator().manual_seed(5)
    up = (torch.randn(512, 64, generator=g) * 0.1).bfloat16()
    down = (torch.randn(64, 1024, generator=g) * 0.1).bfloat16()
    delta = LoraDelta.of(up.float(), down.float(), 0.7)
    assert delta.up.dtype == torch.bfloat16  # exactly bf16 values: kept in bf16
    assert LoraDelta.of(up.float() + 1e-4, down.float(), 1.0).up.dtype == torch.float32
    want = 0.7 * (up.double() @ down.double())
    got = torch.zeros(512, 1024, device="cuda")
    delta.apply(got)
    assert (got.cpu().double() - want).abs().max() <= 1e-6 * want.abs().max()
    rows = torch.zeros(100, 1024, device="cuda")
    delta.apply(rows, slice(200, 300))
    assert torch.allclose(rows.cpu(), got.cpu()[200:300], rtol=0, atol=1e-6)


@needs_triton
def test_a_comfy_quantized_transformer_on_the_gpu_equals_its_dequantized_weights(tmp_path):
    """nvfp4, mxfp8, int8 and int8 ConvRot files on the GPU: the packed rows (the kernels) compute what the
    float32 file of the same values computes (fp32, 1e-5)."""
    from gguf_support import AV_ODD_CASE, comfy_quant_pair, rel, wide_file
    from sp_harness import run_case

    from ltx_mgpu.denoise.model import load_ltx_model
    from ltx_mgpu.quantized.packed import PackedLinear

    for fmt in ("nvfp4", "mxfp8", "int8", "int8_convrot"):
        path, reference = comfy_quant_pair(wide_file(tmp_path), tmp_path, fmt)
        packed = load_ltx_model(TransformerPlan(path, dtype="fp32"), "cuda")
        dense = load_ltx_model(TransformerPlan(reference, dtype="fp32"), "cuda")
        assert packed.linears == "packed" and any(isinstance(m, PackedLinear) for m in packed.transformer.modules())
        with torch.no_grad():
            got, want = run_case(_on_cuda(packed.transformer), AV_ODD_CASE), run_case(_on_cuda(dense.transformer),
                                                                                      AV_ODD_CASE)
        for a, b in zip(got, want):
            assert rel(a.cpu(), b.cpu()) <= 1e-5, fmt


def _on_cuda(model):
    """``model``'s forward taking ``sp_harness``'s CPU Modalities (moved to the GPU)."""
    import dataclasses

    def move(m):
        if m is None:
            return None
        return dataclasses.replace(m, **{f.name: getattr(m, f.name).cuda() for f in dataclasses.fields(m)
                                         if isinstance(getattr(m, f.name), torch.Tensor)})

    return lambda video, audio, perturbations: model(video=move(video), audio=move(audio), perturbations=perturbations)


# --------------------------------------------------------------------------- generation (prompt enhancement)

GEN_PROMPT = ("<start_of_turn>user\nUser Raw Input Prompt: a red fox in the snow.<end_of_turn>\n"
              "<start_of_turn>model\n")


def _generation(tower):
    from ltx_mgpu.text.generate.causal_lm import GemmaGenerator
    from ltx_mgpu.text.generate.tokens import GenerationTokenizer, sentencepiece_model

    ids = GenerationTokenizer(tower, sentencepiece_model(tower)).prompt_ids(GEN_PROMPT, 1024)
    return ids, GemmaGenerator


def test_greedy_generation_on_cuda_equals_transformers_generate():
    """fp32 on the GPU: the pool's generator (eager, dynamic cache) gives transformers' own
    ``generate`` tokens on the same weights (its ``Gemma3ForConditionalGeneration``)."""
    from transformers import Gemma3ForConditionalGeneration

    from ltx_mgpu.text.generate.options import GenerateOptions

    tower = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", dtype=torch.float32)
    ids, GemmaGenerator = _generation(tower)
    ours = GemmaGenerator(tower).generate(ids, GenerateOptions(do_sample=False, max_length=48, stop_tokens=()))
    hf = Gemma3ForConditionalGeneration.from_pretrained(str(tiny_gemma_dir()), dtype=torch.float32,
                                                        device_map={"": "cuda"}).eval()
    x = torch.tensor([ids], device="cuda")
    out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=48, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    assert ours.tokens == out[0, len(ids):].tolist() and len(ours.tokens) == 48


def test_compiled_generation_on_a_static_cache_equals_the_eager_one():
    """The text encoder's ``compile``: transformers' static cache and auto-compile (CUDA graphs)
    give the eager tokens (fp32), greedy and sampled with a seed."""
    from ltx_mgpu.text.generate.options import GenerateOptions

    tower = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", dtype=torch.float32)
    ids, GemmaGenerator = _generation(tower)
    eager, compiled = GemmaGenerator(tower), GemmaGenerator(tower, compile=True)
    for options in (GenerateOptions(do_sample=False, max_length=40, stop_tokens=()),
                    GenerateOptions(do_sample=True, seed=3, max_length=40, temperature=0.7, top_k=64, top_p=0.95,
                                    min_p=0.05, repetition_penalty=1.05, stop_tokens=())):
        want = eager.generate(ids, options).tokens
        assert compiled.generate(ids, options).tokens == want
        assert compiled.generate(ids, options).tokens == want  # the compiled graphs replayed
    assert getattr(compiled.causal_lm(), "_compiled_call", None) is not None


def test_generation_with_an_image_on_cuda_equals_transformers_and_compiles():
    """fp32 on the GPU with an image (the vision tower on the GPU, ``Generation.image_tokens``):
    transformers' ``Gemma3ForConditionalGeneration.generate`` tokens (ComfyUI's epsilons, the
    image ids where ComfyUI splices the soft tokens), and the static cache + compile give the
    eager tokens from the spliced embeddings, greedy and sampled."""
    from transformers import Gemma3ForConditionalGeneration

    from ltx_mgpu.pool.generate_jobs import Generation
    from ltx_mgpu.text.gemma.vision import COMFY_LAYER_NORM_EPS
    from ltx_mgpu.text.generate.image import tokenizer_image, vision_pixels
    from ltx_mgpu.text.generate.options import GenerateOptions
    from ltx_mgpu.text.generate.tokens import IMAGE_SOFT_TOKEN, GenerationTokenizer, sentencepiece_model

    tower = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", dtype=torch.float32)
    _, GemmaGenerator = _generation(tower)
    tokens = GenerationTokenizer(tower, sentencepiece_model(tower))
    ids = tokens.prompt_ids(GEN_PROMPT.replace("user\n", "user\n\n<image_soft_token>\n\n"), 1024)
    image = tokenizer_image(torch.rand(1, 37, 53, 3, generator=torch.Generator().manual_seed(0)))
    generation = Generation(tokens, GemmaGenerator(tower))
    soft = generation.image_tokens(image)
    assert soft.device.type == "cuda" and soft.shape == (4, tower.hidden_size)
    greedy = GenerateOptions(do_sample=False, max_length=40, stop_tokens=())
    ours = generation.generator.generate(ids, greedy, image_tokens=soft).tokens
    hf = Gemma3ForConditionalGeneration.from_pretrained(str(tiny_gemma_dir()), dtype=torch.float32,
                                                        device_map={"": "cuda"}).eval()
    for module in hf.model.vision_tower.modules():
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = COMFY_LAYER_NORM_EPS
    hf.model.multi_modal_projector.mm_soft_emb_norm.eps = hf.config.text_config.rms_norm_eps
    at = ids.index(IMAGE_SOFT_TOKEN)
    x = torch.tensor([ids[:at] + [hf.config.image_token_id] * 4 + ids[at + 1:]], device="cuda")
    out = hf.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=vision_pixels(image, 28).cuda(),
                      max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == out[0, x.shape[1]:].tolist() and len(ours) == 40
    compiled = GemmaGenerator(tower, compile=True)
    for options in (greedy, GenerateOptions(do_sample=True, seed=3, max_length=40, temperature=0.7, top_k=64,
                                            top_p=0.95, min_p=0.05, repetition_penalty=1.05, stop_tokens=())):
        want = generation.generator.generate(ids, options, image_tokens=soft).tokens
        assert compiled.generate(ids, options, image_tokens=soft).tokens == want


@needs_bnb
def test_nf4_generation_on_cuda_decodes_through_bitsandbytes():
    """The NF4 loader's defaults (host table, layer-wise dequant for the encoder) generate the
    tokens of a plain NF4 tower: generation bypasses the layer-wise dequant (bitsandbytes'
    Linear4bit per token) and puts the table on the GPU as the head."""
    from ltx_mgpu.text.generate.options import GenerateOptions
    from ltx_mgpu.text.nf4.dequant import installed_fast_dequant

    default = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", weights="nf4")
    plain = load_gemma_text_tower(tiny_gemma_dir(), device="cuda", weights="nf4", host_embeddings=False,
                                  layer_dequant=False)
    assert installed_fast_dequant(default.model) is not None and installed_fast_dequant(plain.model) is None
    ids, GemmaGenerator = _generation(default)
    options = GenerateOptions(do_sample=False, max_length=32, stop_tokens=())
    got = GemmaGenerator(default).generate(ids, options)
    assert got.tokens == GemmaGenerator(plain).generate(ids, options).tokens
    assert GemmaGenerator(default).causal_lm().lm_head.weight.device.type == "cuda"


def test_generate_and_a_lora_through_a_gpu_pool_equal_in_process():
    """A one-GPU pool: ``generate`` gives the in-process generator's tokens on the same GPU, and a
    LoRA'd encode the in-process encoder with the LoRA merged (fp32)."""
    import types

    from ltx_mgpu.client.lora import text_patches
    from ltx_mgpu.client.pool_client import PoolClient
    from ltx_mgpu.client.text import encode_prompts, generate_text
    from ltx_mgpu.denoise.patches import WeightPatch
    from ltx_mgpu.text.encoder.local import LocalTextEncoder
    from ltx_mgpu.text.gemma.lora import COMFY_TOWER_PREFIX, TowerPatches
    from ltx_mgpu.text.generate.options import GenerateOptions

    config = TextEncoderConfig(str(tiny_gemma_dir()), str(tiny_ltx_checkpoint("2.3")), dtype="float32")
    local = LocalTextEncoder(config, "cuda").build()
    ids, GemmaGenerator = _generation(local.tower)
    options = GenerateOptions(do_sample=False, max_length=32, stop_tokens=())
    want = GemmaGenerator(local.tower).generate(ids, options).tokens
    key = COMFY_TOWER_PREFIX + "layers.1.mlp.up_proj.weight"
    g = torch.Generator().manual_seed(0)
    up, down = 0.1 * torch.randn(128, 2, generator=g), 0.1 * torch.randn(2, 64, generator=g)
    adapter = types.SimpleNamespace(name="lora", weights=(up, down, None, None, None, None))
    patches = text_patches({key: [(0.8, adapter, 1.0, None, None)]})
    merger = TowerPatches(local.tower)
    merger.set({key: [WeightPatch("lora", 0.8, up=up, down=down)]})
    lora_want = local.encode(["a red fox"])[0].tensor
    merger.set({})
    base = short_dir()
    client = PoolClient.connect(gpus="0", runtime_dir=base, lifetime="with-owner", startup_timeout=300)
    try:
        got = generate_text(client, config, GEN_PROMPT, options, timeout=600)
        lora_got = encode_prompts(client, config, ["a red fox"], patches=patches)[0][0].tensor
    finally:
        client.shutdown()
        cleanup(base)
    assert got["tokens"] == want
    torch.testing.assert_close(lora_got, lora_want, rtol=1e-5, atol=1e-6)
