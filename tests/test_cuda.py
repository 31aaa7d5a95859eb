"""GPU-only paths of the text engine, run on a CUDA machine (skipped, with the reason, without one):
the pipelined projection + pinned host copy, the host embedding table, and the NF4 loader's
defaults (host embeddings + layer-wise dequant) against bitsandbytes' own path."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from ltx_mgpu.assets import tiny_gemma_dir, tiny_ltx_checkpoint
from ltx_mgpu.text.encoder import PromptEncoder
from ltx_mgpu.text.features import load_projection
from ltx_mgpu.text.forward import HostEmbedding, run_tower
from ltx_mgpu.text.gemma import load_gemma_text_tower, tokenize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
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
    from ltx_mgpu.text.nf4 import save_nf4

    save_nf4(default, tmp_path / "nf4")
    again = load_gemma_text_tower(tmp_path / "nf4", device="cuda")
    c = run_tower(again, ids, mask).hidden_states
    for x, y in zip(a, c):
        assert torch.equal(x[keep], y[keep])


@needs_bnb
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
@pytest.mark.parametrize("shape", [(64, 64), (3840, 4096), (15360, 3840), (8, 96)])
def test_triton_nf4_dequant_is_bit_identical_to_bitsandbytes(shape):
    import bitsandbytes.functional as bf

    from ltx_mgpu.text.nf4_triton import dequantize_nf4_triton
    from ltx_mgpu.text.nf4_dequant import dequantize_absmax

    torch.manual_seed(0)
    w = (torch.randn(shape, device="cuda") * 0.02).to(torch.bfloat16)
    w[0, :5] = torch.tensor([0.0, 1e-8, -3.0, 2.5, 65504.0])  # zero, tiny, large
    packed, qs = bf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    ref = bf.dequantize_4bit(packed, qs)
    out = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
    dequantize_nf4_triton(packed, dequantize_absmax(qs), qs.code, qs.blocksize, out.view(-1))
    assert torch.equal(out, ref)
