"""Feature-extractor parity with a straightforward per-prompt computation (ComfyUI's way:
trim the left padding, then normalise and project), for the LTX-2.0 and 2.3 layouts."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from ltx_mgpu.text.features import (
    Projection,
    ProjectionFormatError,
    PromptEmbedding,
    detect_projection_version,
    load_projection,
    projection_identity,
)

D, L = 16, 5


def _weights(version, gen):
    if version == "2.0":
        return {"aggregate_embed.weight": torch.randn(24, D * L, generator=gen) * 0.05}
    return {
        "video_aggregate_embed.weight": torch.randn(20, D * L, generator=gen) * 0.05,
        "video_aggregate_embed.bias": torch.randn(20, generator=gen),
        "audio_aggregate_embed.weight": torch.randn(12, D * L, generator=gen) * 0.05,
        "audio_aggregate_embed.bias": torch.randn(12, generator=gen),
    }


def _reference(version, weights, hidden, lengths):
    """Per prompt, float64: trim to the valid (rightmost) tokens, then the textbook formula."""
    outs = []
    stacked = torch.stack(hidden, dim=1).double()  # [B, L, T, D]
    for b, n in enumerate(lengths):
        x = stacked[b, :, stacked.shape[2] - n:, :].movedim(0, -1)  # [n, D, L]
        if version == "2.0":
            mean = x.mean(dim=(0, 1), keepdim=True)
            rng = x.amax(dim=(0, 1), keepdim=True) - x.amin(dim=(0, 1), keepdim=True)
            feats = (8.0 * (x - mean) / (rng + 1e-6)).reshape(n, -1)
            outs.append(feats @ weights["aggregate_embed.weight"].double().T)
        else:
            normed = (x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-6)).reshape(n, -1)
            parts = []
            for name in ("video", "audio"):
                w = weights[f"{name}_aggregate_embed.weight"].double()
                bias = weights[f"{name}_aggregate_embed.bias"].double()
                parts.append((normed * math.sqrt(w.shape[0] / D)) @ w.T + bias)
            outs.append(torch.cat(parts, dim=-1))
    return outs


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_projection_matches_per_prompt_reference_with_left_padding(version):
    gen = torch.Generator().manual_seed(1)
    weights = _weights(version, gen)
    proj = Projection(version, D, L, {k: v.clone() for k, v in weights.items()})
    lengths = [9, 4, 1]
    T = max(lengths)
    hidden = [torch.randn(len(lengths), T, D, generator=gen) * (1 + i) for i in range(L)]
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1
        for h in hidden:  # garbage in the pad rows must not leak into the statistics
            h[b, : T - n] = 1e4
    out = proj(hidden, mask)
    ref = _reference(version, weights, hidden, lengths)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(out[b, T - n:].double(), ref[b], rtol=1e-5, atol=1e-5)
        assert torch.all(out[b, : T - n] == 0)
    assert out.shape == (3, T, proj.out_features)


def test_projection_rejects_wrong_gemma():
    proj = Projection("2.0", D, L, _weights("2.0", torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="takes 5 hidden states"):
        proj([torch.zeros(1, 2, D)] * (L - 1), torch.ones(1, 2))
    with pytest.raises(ValueError, match="hidden size 16"):
        proj([torch.zeros(1, 2, D + 1)] * L, torch.ones(1, 2))


@pytest.mark.parametrize("prefix", ["text_embedding_projection.", ""])
@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_load_projection_from_checkpoint_or_standalone(tmp_path, version, prefix):
    weights = _weights(version, torch.Generator().manual_seed(2))
    tensors = {prefix + k: v for k, v in weights.items()}
    tensors["model.diffusion_model.unrelated.weight"] = torch.zeros(2)
    path = tmp_path / "ckpt.safetensors"
    save_file(tensors, str(path))
    proj = load_projection(path, num_layers=L)
    assert proj.version == version and proj.embedding_dim == D and proj.num_layers == L
    assert proj.identity == projection_identity(path)
    hidden = [torch.randn(1, 3, D) for _ in range(L)]
    ref = Projection(version, D, L, weights)(hidden, torch.ones(1, 3))
    torch.testing.assert_close(proj(hidden, torch.ones(1, 3)), ref)


def test_projection_identity_changes_with_content(tmp_path):
    w = _weights("2.3", torch.Generator().manual_seed(3))
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(w, str(a))
    w2 = {k: v.clone() for k, v in w.items()}
    w2["video_aggregate_embed.bias"][0] += 1
    save_file(w2, str(b))
    assert projection_identity(a) != projection_identity(b)


def test_no_projection_is_a_clear_error(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file({"foo": torch.zeros(1)}, str(path))
    with pytest.raises(ProjectionFormatError, match="aggregate_embed"):
        load_projection(path)
    with pytest.raises(ProjectionFormatError):
        detect_projection_version(["text_embedding_projection.video_aggregate_embed.weight"])


def test_conditioning_form():
    e = PromptEmbedding(torch.randn(7, 12), "2.3")
    cond = e.to_conditioning()
    assert len(cond) == 1 and cond[0][0].shape == (1, 7, 12) and cond[0][0].dtype == torch.float32
    assert cond[0][1] == {"pooled_output": None, "unprocessed_ltxav_embeds": True}
    with pytest.raises(ValueError):
        PromptEmbedding(torch.randn(1, 7, 12), "2.3")
