"""ComfyUI's weight patches on the LTX-2 text projection and on the whole text encoder
(``ltx_mgpu.text.encoder.patches``).

* ComfyUI's names and shapes of the projection's weights (``LTXAVTEModel.text_embedding_projection``
  in ComfyUI 0.20.1: ``text_embedding_projection.weight`` for LTX-2.0, ``text_embedding_projection.
  {video,audio}_aggregate_embed.{weight,bias}`` for LTX-2.3), from a checkpoint or a bare
  projection file;
* a patched projection equals a projection loaded from ComfyUI's merged weights (float32 merge in
  the checkpoint's feature order, rounded to the file's bf16): the stored parameters are equal and
  so are the outputs; bias diffs (``.diff_b``) merge; ``set({})`` and a changed set restore exactly;
* ComfyUI's names of the vision tower's and projector's weights (``Gemma3_12B.vision_model``, a
  ``CLIPVision`` with SigLIP's names, and ``.multi_modal_projector``) are the loaded ``GemmaVision``'s
  parameters under ComfyUI's prefixes; vision patches kept before the tower loads merge when it is
  attached, a changed set restores and merges (rounded to the file's bf16, as ComfyUI), and a
  Gemma without a vision tower refuses vision keys naming the fix;
* the whole encoder's set sends each key to its part, refuses a key of neither part, a projection
  key of the other LTX-2 version and a factor that does not fit, before any weight changes.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ltx_mgpu.denoise.patches import WeightPatch
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.encoder.patches import (
    COMFY_PROJECTION_PREFIX,
    EncoderPatches,
    ProjectionPatches,
    VisionPatches,
    comfy_projection_keys,
    comfy_vision_key,
    comfy_vision_keys,
)
from ltx_mgpu.text.features import load_projection
from ltx_mgpu.text.gemma.lora import COMFY_TOWER_PREFIX

D, L = 4, 3
WIDTHS = {"2.0": {"aggregate_embed": 5}, "2.3": {"video_aggregate_embed": 6, "audio_aggregate_embed": 4}}
COMFY_NAMES = {"aggregate_embed.weight": "weight"}  # LTX-2.0's one renamed key (LTXAVTEModel.load_sd)


def _file_weights(version: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, width in WIDTHS[version].items():
        out[f"{name}.weight"] = torch.randn(width, D * L, generator=g).to(torch.bfloat16)
        if version == "2.3":
            out[f"{name}.bias"] = torch.randn(width, generator=g).to(torch.bfloat16)
    return out


def _write(tmp_path, version: str, weights: dict[str, torch.Tensor], prefix: str = "text_embedding_projection."):
    path = tmp_path / f"proj-{version}-{len(prefix)}.safetensors"
    save_file({prefix + k: v.contiguous() for k, v in weights.items()}, str(path))
    return path


def _comfy_key(name: str) -> str:
    return COMFY_PROJECTION_PREFIX + COMFY_NAMES.get(name, name)


def _lora(shape, strength=0.7, alpha=2.0, seed=1, **kw) -> WeightPatch:
    g = torch.Generator().manual_seed(seed)
    return WeightPatch("lora", strength, up=torch.randn(shape[0], 2, generator=g),
                       down=torch.randn(2, shape[1], generator=g), alpha=alpha, **kw)


def _comfy_merge(loaded: torch.Tensor, patches) -> torch.Tensor:
    """ComfyUI's merge (``patch_weight_to_device`` + ``calculate_weight``) into a bf16 weight."""
    w = loaded.to(torch.float32, copy=True)
    for p in patches:
        if p.strength_model != 1.0:
            w *= p.strength_model
        if p.kind == "lora":
            w += ((p.strength * p.alpha / p.down.shape[0]) * torch.mm(p.up, p.down)).type(w.dtype)
        else:
            w += p.strength * p.diff.float()
    return w.to(torch.bfloat16)


@pytest.mark.parametrize("version", ["2.0", "2.3"])
@pytest.mark.parametrize("prefix", ["text_embedding_projection.", ""])
def test_comfyuis_names_and_shapes_of_the_projection(tmp_path, version, prefix):
    weights = _file_weights(version)
    keys = comfy_projection_keys(_write(tmp_path, version, weights, prefix))
    assert keys == {_comfy_key(k): tuple(v.shape) for k, v in weights.items()}
    if version == "2.0":
        assert keys == {"text_embedding_projection.weight": (5, D * L)}
    else:
        assert set(keys) == {f"text_embedding_projection.{s}_aggregate_embed.{p}"
                             for s in ("video", "audio") for p in ("weight", "bias")}


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_a_patched_projection_is_comfyuis_merged_projection(tmp_path, version):
    weights = _file_weights(version)
    proj = load_projection(_write(tmp_path, version, weights), dtype=torch.float32, num_layers=L)
    loaded = {n: p.detach().clone() for n, p in proj.named_parameters()}
    patches = {}
    for name, w in weights.items():
        if name.endswith(".weight"):
            patches[name] = [_lora(w.shape, strength_model=0.5), _lora(w.shape, strength=-1.0, seed=2)]
        else:
            g = torch.Generator().manual_seed(3)
            patches[name] = [WeightPatch("diff", 0.3, diff=torch.randn(w.shape, generator=g))]
    merged = {name: _comfy_merge(weights[name], plist) for name, plist in patches.items()}
    reference = load_projection(_write(tmp_path, version, merged, prefix=""), dtype=torch.float32, num_layers=L)

    state = ProjectionPatches(proj)
    assert state.set({_comfy_key(k): v for k, v in patches.items()}) == {_comfy_key(k) for k in patches}
    for (n, p), (_, r) in zip(proj.named_parameters(), reference.named_parameters()):
        assert torch.equal(p, r), n
    states = [torch.randn(2, 3, D, generator=torch.Generator().manual_seed(4)) for _ in range(L)]
    mask = torch.ones(2, 3)
    assert torch.equal(proj(states, mask), reference(states, mask))
    assert not torch.equal(proj(states, mask), load_projection(_write(tmp_path, version, weights), num_layers=L)(
        states, mask))

    first = sorted(patches)[0]
    assert state.set({_comfy_key(first): patches[first]}) == {_comfy_key(first)}  # replaced, not added
    for n, p in proj.named_parameters():
        assert torch.equal(p, loaded[n]) != (n == first)
    assert state.set({}) == set()
    assert all(torch.equal(p, loaded[n]) for n, p in proj.named_parameters())


def test_the_encoders_set_sends_each_key_to_its_part_and_refuses_before_any_change(tmp_path, gemma):
    tower = load_gemma_text_tower(gemma["comfy"], dtype=torch.float32)
    weights = _file_weights("2.3")
    proj = load_projection(_write(tmp_path, "2.3", weights), dtype=torch.float32, num_layers=L)
    q = tower.model.layers[0].self_attn.q_proj.weight
    tower_key = COMFY_TOWER_PREFIX + "layers.0.self_attn.q_proj.weight"
    video_key = COMFY_PROJECTION_PREFIX + "video_aggregate_embed.weight"
    loaded_q, loaded_v = q.detach().clone(), proj.video_aggregate_embed.weight.detach().clone()
    merger = EncoderPatches(tower, proj)
    good = {tower_key: [_lora(q.shape)], video_key: [_lora(weights["video_aggregate_embed.weight"].shape)]}
    cases = {
        "gemma3_12b.transformer.lm_head.weight": "the LoRA patches something else",
        "gemma3_12b.transformer.vision_model.x.weight": "vision tower has no such weight",
        COMFY_PROJECTION_PREFIX + "weight": "LTX-2.3 text projection has no such weight",
        COMFY_PROJECTION_PREFIX + "audio_aggregate_embed.weight": "do not make the weight.s",
    }
    for key, message in cases.items():
        with pytest.raises(ValueError, match=message):
            merger.set({**good, key: [_lora((7, 7))]})
        assert torch.equal(q.detach(), loaded_q) and torch.equal(proj.video_aggregate_embed.weight, loaded_v)
    assert merger.set(good) == set(good)
    assert not torch.equal(q.detach(), loaded_q) and not torch.equal(proj.video_aggregate_embed.weight, loaded_v)
    assert merger.set({}) == set()
    assert torch.equal(q.detach(), loaded_q) and torch.equal(proj.video_aggregate_embed.weight, loaded_v)


# --------------------------------------------------------------------------- the vision tower and projector


def test_comfyuis_names_of_the_vision_weights_are_the_loaded_parameters(gemma):
    from ltx_mgpu.text.gemma.vision import find_vision, load_vision

    source = find_vision(gemma["comfy"])
    model = load_vision(source, gemma["tower"].config)
    keys = comfy_vision_keys(source)
    assert keys == {comfy_vision_key(n): tuple(p.shape) for n, p in model.named_parameters()}
    # ComfyUI's Gemma3_12B: CLIPVision (SigLIP names) as vision_model, Gemma3MultiModalProjector
    assert keys["gemma3_12b.transformer.vision_model.encoder.layers.0.self_attn.q_proj.weight"]
    assert "gemma3_12b.transformer.vision_model.post_layernorm.weight" in keys
    assert "gemma3_12b.transformer.multi_modal_projector.mm_soft_emb_norm.weight" in keys
    with pytest.raises(ValueError, match="not a vision tower or projector parameter"):
        comfy_vision_key("head.probe")


def test_vision_patches_merge_when_attached_and_when_the_set_changes(gemma):
    from ltx_mgpu.text.gemma.vision import find_vision, load_vision

    source = find_vision(gemma["comfy"])
    q_key = "gemma3_12b.transformer.vision_model.encoder.layers.0.self_attn.q_proj.weight"
    norm_key = "gemma3_12b.transformer.multi_modal_projector.mm_soft_emb_norm.weight"
    fresh = load_vision(source, gemma["tower"].config)
    q, norm = fresh.tower.encoder.layers[0].self_attn.q_proj.weight, fresh.projector.mm_soft_emb_norm.weight
    loaded_q, loaded_norm = q.detach().clone(), norm.detach().clone()
    q_patches = [_lora(q.shape, strength_model=0.5)]
    g = torch.Generator().manual_seed(5)
    norm_patches = [WeightPatch("diff", 0.3, diff=torch.randn(norm.shape, generator=g))]

    state = VisionPatches(gemma["comfy"])
    assert state.set({q_key: q_patches}) == {q_key}  # kept: no model yet
    state.attach(fresh)
    assert torch.equal(q.detach(), _comfy_merge(loaded_q, q_patches).float())  # the file's bf16, as ComfyUI
    assert state.set({norm_key: norm_patches}) == {norm_key}
    assert torch.equal(q.detach(), loaded_q)
    assert torch.equal(norm.detach(), _comfy_merge(loaded_norm, norm_patches).float())
    assert state.set({}) == set() and torch.equal(norm.detach(), loaded_norm)
    with pytest.raises(ValueError, match="has no such weight"):
        state.set({"gemma3_12b.transformer.vision_model.encoder.layers.9.mlp.fc1.weight": q_patches})
    with pytest.raises(ValueError, match="do not make the weight.s"):
        state.set({q_key: [_lora((3, 3))]})
    assert torch.equal(q.detach(), loaded_q) and state.keys == set()


def test_vision_keys_on_a_gemma_without_a_vision_tower_are_refused_with_the_fix(gemma, tmp_path):
    from safetensors import safe_open

    text_only = tmp_path / "text-only.safetensors"
    with safe_open(str(gemma["comfy"]), "pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        save_file({k: f.get_tensor(k) for k in names if not k.startswith(("vision_model.", "multi_modal"))},
                  str(text_only), metadata=f.metadata())
    state = VisionPatches(text_only)
    key = "gemma3_12b.transformer.vision_model.post_layernorm.weight"
    with pytest.raises(ValueError, match="has no vision tower"):
        state.set({key: [WeightPatch("diff", 1.0, diff=torch.ones(64))]})
    assert state.set({}) == set()
