"""ComfyUI's weight patches on a loaded Gemma text tower (``ltx_mgpu.text.gemma.lora.TowerPatches``),
and the patch set's identity on the client's side (``ltx_mgpu.client.lora``) and in the cache key.

* a dense weight gets ComfyUI's merge: float32, each patch in order, rounded to the dtype the
  *file* stores (a bf16 file computed in fp32 keeps bf16 values, as ComfyUI's merged weight);
  ``set({})`` puts the loaded weights back exactly, and a new set replaces the old one;
* an NF4 projection computes the patch beside its 4-bit weight: its output equals the merged
  dequantized weight's; removing the set gives the loaded output back exactly;
* a GGUF packed linear merges per call (its bytes untouched); its packed table is refused;
* keys outside the tower, unknown weights and factors that do not fit are refused by key
  before any weight changes;
* ComfyUI's key names are the tower's parameters with ComfyUI's prefix, with their shapes;
* a patch set's content id changes with any strength or factor, not with the adapter object;
  ``CacheKeyParts`` without a LoRA keys entries exactly as before, with one apart.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from ltx_mgpu.client.lora import text_patches
from ltx_mgpu.denoise.patches import WeightPatch
from ltx_mgpu.text.cache.keys import CacheKeyParts, cache_key
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.gemma.lora import COMFY_TOWER_PREFIX, TowerPatches, comfy_clip_keys, tower_parameter_shapes

Q = COMFY_TOWER_PREFIX + "layers.0.self_attn.q_proj.weight"
NORM = COMFY_TOWER_PREFIX + "layers.1.input_layernorm.weight"


def lora(out_f: int, in_f: int, strength: float = 0.7, alpha: float | None = 2.0, seed: int = 0, **kw) -> WeightPatch:
    g = torch.Generator().manual_seed(seed)
    return WeightPatch("lora", strength, up=torch.randn(out_f, 2, generator=g), down=torch.randn(2, in_f, generator=g),
                       alpha=alpha, **kw)


def comfy_merge(loaded: torch.Tensor, patches, stored: torch.dtype) -> torch.Tensor:
    """ComfyUI's ModelPatcher merge (patch_weight_to_device + calculate_weight on the CPU)."""
    w = loaded.to(stored).to(torch.float32, copy=True)
    for p in patches:
        if p.strength_model != 1.0:
            w *= p.strength_model
        if p.kind == "lora":
            scale = p.alpha / p.down.shape[0] if p.alpha is not None else 1.0
            w += ((p.strength * scale) * torch.mm(p.up.float(), p.down.float())).type(w.dtype)
        else:
            w += p.strength * p.diff.float()
    return w.to(stored)


@pytest.mark.parametrize("source, dtype", [("comfy", torch.float32), ("comfy", torch.bfloat16),
                                           ("snapshot", torch.float32)])
def test_a_dense_weight_gets_comfyuis_merge_and_comes_back(gemma, source, dtype):
    tower = load_gemma_text_tower(gemma[source], dtype=dtype)
    q = tower.model.layers[0].self_attn.q_proj.weight
    norm = tower.model.layers[1].input_layernorm.weight
    loaded_q, loaded_norm = q.detach().clone(), norm.detach().clone()
    q_patches = [lora(*q.shape, strength_model=0.5), lora(*q.shape, strength=-1.0, alpha=None, seed=1)]
    norm_patches = [WeightPatch("diff", 0.3, diff=torch.randn(norm.shape, generator=torch.Generator().manual_seed(2)))]
    merged = TowerPatches(tower)
    assert merged.set({Q: q_patches, NORM: norm_patches}) == {Q, NORM}
    # the file stores bf16: the merged weight is bf16 whatever the compute dtype (ComfyUI's)
    assert torch.equal(q.detach(), comfy_merge(loaded_q, q_patches, torch.bfloat16).to(dtype))
    assert torch.equal(norm.detach(), comfy_merge(loaded_norm, norm_patches, torch.bfloat16).to(dtype))
    assert merged.set({NORM: norm_patches}) == {NORM} and torch.equal(q.detach(), loaded_q)  # replaced, not added
    assert merged.set({}) == set()
    assert torch.equal(q.detach(), loaded_q) and torch.equal(norm.detach(), loaded_norm)


def test_an_nf4_projection_adds_the_patch_beside_its_4bit_weight(nf4_tower):
    from ltx_mgpu.text.nf4.dequant import dequantize_nf4

    layer = nf4_tower.model.layers[0].self_attn.q_proj
    x = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    with torch.no_grad():
        before = layer(x)
        patches = [lora(layer.out_features, layer.in_features, strength_model=0.8)]
        merged = TowerPatches(nf4_tower)
        merged.set({Q: patches})
        after = layer(x)
        weight = comfy_merge(dequantize_nf4(layer.weight).float(), patches, torch.float32)
        expected = F.linear(x.float(), weight)
        merged.set({})
        restored = layer(x)
    assert torch.equal(restored, before)
    rel = (after.float() - expected).abs().max() / expected.abs().max()
    assert rel < 2e-2  # bf16 output of the 4-bit GEMM; the patch itself in float32


def test_a_gguf_packed_linear_merges_per_call(tiny_gemma_dir, tmp_path):
    from ltx_mgpu.assets.ggml_export import export_gemma_gguf

    path = export_gemma_gguf(tiny_gemma_dir, tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    tower = load_gemma_text_tower(path, dtype=torch.float32)
    layer = tower.model.layers[0].self_attn.q_proj
    packed = layer.packed().clone()
    x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(4))
    dense = layer.dense(torch.float32)
    patches = [lora(layer.out_features, layer.in_features)]
    merged = TowerPatches(tower)
    merged.set({Q: patches})
    with torch.no_grad():
        torch.testing.assert_close(layer(x), F.linear(x, comfy_merge(dense, patches, torch.float32)),
                                   rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.packed(), packed)  # the file's bytes are untouched
    merged.set({})
    assert layer.patches == () and torch.equal(layer.dense(torch.float32), dense)
    if type(tower.model.embed_tokens).__name__ == "PackedEmbedding":
        with pytest.raises(ValueError, match="packed embedding table cannot be patched"):
            merged.set({COMFY_TOWER_PREFIX + "embed_tokens.weight": [lora(512, 64)]})


def test_what_does_not_fit_is_refused_by_key_before_any_change(gemma):
    tower = load_gemma_text_tower(gemma["comfy"], dtype=torch.float32)
    q = tower.model.layers[0].self_attn.q_proj.weight
    loaded = q.detach().clone()
    merged = TowerPatches(tower)
    cases = {
        "text_encoders.t5xxl.transformer.x.weight": (r"only the Gemma text tower's weights", lora(4, 4)),
        COMFY_TOWER_PREFIX + "layers.99.mlp.up_proj.weight": ("has no such weight", lora(4, 4)),
        COMFY_TOWER_PREFIX + "layers.0.self_attn.k_proj.weight": ("do not make the weight.s", lora(64, 64)),
    }
    for key, (message, patch) in cases.items():
        with pytest.raises(ValueError, match=message):
            merged.set({Q: [lora(*q.shape)], key: [patch]})
        assert torch.equal(q.detach(), loaded) and merged.keys == set()


def test_comfyuis_names_of_the_tower_weights(gemma):
    tower = gemma["tower"]
    keys = comfy_clip_keys(tower_parameter_shapes(tower.config))
    assert keys == {COMFY_TOWER_PREFIX + n: tuple(p.shape) for n, p in tower.model.named_parameters()}
    assert keys[Q] == (64, 64) and COMFY_TOWER_PREFIX + "embed_tokens.weight" in keys


def _adapter(up, down, alpha=None):
    """A stand-in for ComfyUI's ``LoRAAdapter`` (``name``, ``weights``)."""
    return types.SimpleNamespace(name="lora", weights=(up, down, alpha, None, None, None))


def test_a_patch_sets_identity_is_its_content():
    g = torch.Generator().manual_seed(5)
    up, down = torch.randn(64, 2, generator=g), torch.randn(2, 64, generator=g)

    def patchset(strength=1.0, adapter=None, alpha=None):
        return text_patches({Q: [(strength, adapter or _adapter(up, down, alpha), 1.0, None, None)]})

    a = patchset()
    assert a.identity.startswith("lora:") and a.identity == patchset().identity  # a fresh object, same content
    assert len({a.identity, patchset(0.5).identity, patchset(alpha=1.0).identity,
                patchset(adapter=_adapter(up * 2, down)).identity}) == 4
    assert text_patches({}) is None and text_patches(None) is None


def test_the_cache_key_takes_the_lora_only_when_there_is_one():
    parts = CacheKeyParts("g" * 8, "p" * 8, "bf16")
    assert parts.to_json() == ('{"dtype":"bfloat16","gemma_identity":"gggggggg","projection_identity":"pppppppp",'
                               '"token_budget":1024,"weights_mode":"bf16"}')  # as before LoRAs existed
    with_lora = CacheKeyParts("g" * 8, "p" * 8, "bf16", lora="lora:abc")
    assert cache_key("a fox", with_lora) != cache_key("a fox", parts)
    assert '"lora":"lora:abc"' in with_lora.to_json()
