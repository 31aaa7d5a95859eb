"""Loading the LTX-2 denoiser: both checkpoint layouts (with and without stored config) give
identical outputs, fp8 storage loads close to bf16, a missing-and-uninferable config fails
clearly, LoRAs fuse as ComfyUI fuses them, the connectors pad with registers exactly as
ComfyUI's ``Embeddings1DConnector`` does, and the attention's query / key norms take ComfyUI's
epsilon. Tiny checkpoints, float32, CPU."""

from __future__ import annotations

import json

import pytest
import torch
from ltx_core.components.patchifiers import AudioPatchifier, VideoLatentPatchifier
from ltx_core.model.transformer import Modality
from ltx_core.model.transformer.attention import Attention
from ltx_core.model.transformer.rope import generate_freq_grid_np, precompute_freqs_cis
from ltx_core.tools import AudioLatentTools, VideoLatentTools
from ltx_core.types import AudioLatentShape, VideoLatentShape
from ltx_core.utils import rms_norm
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ltx_mgpu.denoise.checkpoint import CheckpointError, LoraSpec, infer_transformer_config, inspect_checkpoint
from ltx_mgpu.denoise.comfyui.conditioning import run_connector, text_contexts
from ltx_mgpu.denoise.comfyui.qk_norm import COMFY_QK_NORM_EPS
from ltx_mgpu.denoise.model import export_transformer_only, load_ltx_model
from ltx_mgpu.denoise.plan import TransformerPlan

F32 = torch.float32
WIDTH = {"2.0": 64, "2.3": 48}  # unprocessed context width of the tiny checkpoints (2.3: 32 + 16)


@pytest.fixture(scope="module")
def ckpt(tiny_ltx_20, tiny_ltx_23):
    return {"2.0": tiny_ltx_20, "2.3": tiny_ltx_23}


def _outputs(model, version: str, seed: int = 3):
    """Connector contexts and one transformer forward (velocities) on fixed inputs."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randn(1, 9, WIDTH[version], generator=g)
    vctx, actx = text_contexts(model, ctx, True)
    vshape, ashape = VideoLatentShape(1, 128, 2, 3, 4), AudioLatentShape(1, 8, 5, 16)
    vpos = VideoLatentTools(VideoLatentPatchifier(1), vshape, fps=25.0).create_initial_state("cpu", F32).positions
    apos = AudioLatentTools(AudioPatchifier(1), ashape).create_initial_state("cpu", F32).positions
    sigma, dt = torch.tensor([0.6]), model.dtype
    video = Modality(torch.randn(1, 24, 128, generator=g).to(dt), sigma, sigma.expand(1, 24), vpos, vctx)
    audio = Modality(torch.randn(1, 5, 128, generator=g).to(dt), sigma, sigma.expand(1, 5), apos, actx)
    with torch.no_grad():
        vx, ax = model.transformer(video, audio, None)
    return [vctx.float(), actx.float(), vx.float(), ax.float()]


def _assert_equal(a, b):
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_layouts_give_identical_outputs(ckpt, version, tmp_path):
    ref_model = load_ltx_model(TransformerPlan(ckpt[version], dtype="fp32"))
    assert ref_model.version == version
    ref = _outputs(ref_model, version)
    layouts = [("model.diffusion_model.", True), ("", True)]
    if version == "2.3":
        layouts.append(("", False))  # no config: inferred from shapes (gate logits count heads)
    for prefix, keep in layouts:
        path = export_transformer_only(ckpt[version], tmp_path / f"dit_{bool(prefix)}_{keep}.safetensors",
                                       prefix=prefix, keep_config=keep)
        with safe_open(str(path), "pt") as f:
            assert all(k.startswith(prefix) for k in f.keys())  # noqa: SIM118 - safe_open is not iterable
            assert not any(k.startswith(("vae.", "text_embedding_projection."))
                           for k in f.keys())  # noqa: SIM118 - safe_open is not iterable
            assert ("config" in (f.metadata() or {})) == keep
        info = inspect_checkpoint(path)
        assert (info.prefix, info.version, info.config_source) == (prefix, version, "metadata" if keep else "inferred")
        _assert_equal(ref, _outputs(load_ltx_model(TransformerPlan(path, dtype="fp32")), version))


def test_inferred_config_matches_the_stored_one(ckpt):
    info = inspect_checkpoint(ckpt["2.3"])
    inferred = infer_transformer_config(info.shapes)
    for key, value in inferred.items():
        if key in info.config["transformer"]:
            assert info.config["transformer"][key] == value, key


def test_missing_config_that_shapes_cannot_determine_fails_clearly(ckpt, tmp_path):
    # LTX-2.0 has no gate logits, so heads come from LTX-2's head size 128 — the tiny 32-wide
    # model does not fit it, and without metadata there is nothing else to go by.
    path = export_transformer_only(ckpt["2.0"], tmp_path / "dit20_noconfig.safetensors", prefix="", keep_config=False)
    with pytest.raises(CheckpointError, match=r"no 'config' metadata.*video attention heads.*'config' metadata"):
        load_ltx_model(TransformerPlan(path, dtype="fp32"))
    other = tmp_path / "not_ltx.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.weight": torch.zeros(2, 2)}, str(other))
    with pytest.raises(CheckpointError, match="not an LTX-2 audio-video transformer"):
        load_ltx_model(TransformerPlan(other, dtype="fp32"))


def test_config_that_does_not_fit_the_weights_is_rejected(ckpt, tmp_path):
    info = inspect_checkpoint(ckpt["2.3"])
    cfg = dict(info.config["transformer"], apply_gated_attention=False)
    src = tmp_path / "wrong_config.safetensors"
    with safe_open(str(ckpt["2.3"]), "pt") as f:
        save_file({k: f.get_tensor(k) for k in f.keys()}, str(src),  # noqa: SIM118 - safe_open is not iterable
                  metadata={"config": json.dumps({"transformer": cfg})})
    with pytest.raises(CheckpointError, match="do not fit.*unexpected"):
        load_ltx_model(TransformerPlan(src, dtype="fp32"))


@pytest.mark.parametrize("mode", ["cast", "scaled"])
def test_fp8_weights_load_upcast_and_close_to_bf16(ckpt, tmp_path, mode):
    path = export_transformer_only(ckpt["2.3"], tmp_path / f"dit_fp8_{mode}.safetensors", fp8=mode)
    model = load_ltx_model(TransformerPlan(path, dtype="fp32"))
    key = "transformer_blocks.0.attn1.to_q.weight"
    with safe_open(str(ckpt["2.3"]), "pt") as f:
        w = f.get_tensor("model.diffusion_model." + key)
    if mode == "cast":
        expect = w.to(torch.float8_e4m3fn).float()
    else:
        s = w.abs().amax() / torch.finfo(torch.float8_e4m3fn).max
        expect = (w / s).to(torch.float8_e4m3fn).float() * s
    assert model.transformer.state_dict()[key].dtype == F32
    torch.testing.assert_close(model.transformer.state_dict()[key], expect, rtol=1e-6, atol=0)
    bf16 = _outputs(load_ltx_model(TransformerPlan(ckpt["2.3"])), "2.3")
    got = _outputs(model, "2.3")
    for x, y in zip(got[2:], bf16[2:], strict=True):  # velocities; the connectors are not fp8
        assert (x - y).abs().max() <= 0.06 * y.abs().max()  # measured ~0.02-0.04


def test_weight_scale_and_comfy_quant_fp8_formats(ckpt, tmp_path):
    """ComfyUI's quant format (``weight_scale`` + ``comfy_quant``) loads like its legacy
    ``scale_weight`` one; a format ltx_mgpu does not read is refused by name at the header, and so
    is a marker that does not fit the stored weight (nvfp4 and int8 files:
    ``test_comfy_quant_transformer.py``)."""
    legacy = export_transformer_only(ckpt["2.3"], tmp_path / "legacy.safetensors", fp8="scaled")
    with safe_open(str(legacy), "pt") as f:
        sd, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118 - safe_open is not iterable

    def rewrite(name, fmt):
        out = {}
        for k, v in sd.items():
            if k.endswith(".scale_weight"):
                stem = k[: -len(".scale_weight")]
                out[stem + ".weight_scale"] = v
                out[stem + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt}).encode()), dtype=torch.uint8)
            elif not k.endswith("scaled_fp8"):
                out[k] = v
        save_file(out, str(tmp_path / name), metadata=meta)
        return tmp_path / name

    ref = _outputs(load_ltx_model(TransformerPlan(legacy, dtype="fp32")), "2.3")
    _assert_equal(ref, _outputs(load_ltx_model(TransformerPlan(rewrite("quant.safetensors", "float8_e4m3fn"),
                                                               dtype="fp32")), "2.3"))
    with pytest.raises(CheckpointError, match=r"is stored as ComfyUI 'convrot_w4a4' \(4-bit weights and activations "
                                              r"with a Hadamard rotation\), which ltx_mgpu cannot read yet"):
        inspect_checkpoint(rewrite("w4a4.safetensors", "convrot_w4a4"))
    with pytest.raises(CheckpointError, match="is marked 'nvfp4', whose weight ComfyUI stores as a 2-D U8 tensor, but"):
        load_ltx_model(TransformerPlan(rewrite("nvfp4.safetensors", "nvfp4"), dtype="fp32"))


def _write_lora(path, entries: dict, form: str = "A/B") -> None:
    """entries: module -> (A [r, in], B [out, r], alpha or None); ComfyUI (A/B) or kohya naming."""
    sd = {}
    for module, (a, b, alpha) in entries.items():
        if form == "A/B":
            name, down, up = f"diffusion_model.{module}", "lora_A", "lora_B"
        else:
            name, down, up = "lora_unet_" + module.replace(".", "_"), "lora_down", "lora_up"
        sd[f"{name}.{down}.weight"], sd[f"{name}.{up}.weight"] = a, b
        if alpha is not None:
            sd[f"{name}.alpha"] = torch.tensor(alpha)
    save_file(sd, str(path))


LORA_TARGETS = ("transformer_blocks.0.attn1.to_q", "transformer_blocks.1.ff.net.0.proj",
                "video_embeddings_connector.transformer_1d_blocks.0.attn1.to_v")


def _lora_entries(model, rank=2, seed=5):
    g = torch.Generator().manual_seed(seed)
    sd = {**{k: v for k, v in model.transformer.state_dict().items()},
          **{f"video_embeddings_connector.{k}": v for k, v in model.video_connector.state_dict().items()}}
    out = {}
    for m in LORA_TARGETS:
        o, i = sd[m + ".weight"].shape
        out[m] = (torch.randn(rank, i, generator=g), 0.5 * torch.randn(o, rank, generator=g), None)
    return out


def test_lora_changes_output_strength_zero_does_not(ckpt, tmp_path):
    base = load_ltx_model(TransformerPlan(ckpt["2.3"], dtype="fp32"))
    entries = _lora_entries(base)
    lora = tmp_path / "lora.safetensors"
    _write_lora(lora, entries)
    ref = _outputs(base, "2.3")
    _assert_equal(ref, _outputs(load_ltx_model(TransformerPlan(ckpt["2.3"], dtype="fp32", loras=[(str(lora), 0.0)])),
                                                               "2.3"))
    fused = load_ltx_model(TransformerPlan(ckpt["2.3"], dtype="fp32", loras=[LoraSpec(str(lora), 0.7)]))
    got = _outputs(fused, "2.3")
    assert not torch.allclose(got[0], ref[0]) and not torch.allclose(got[2], ref[2])  # connector and DiT changed
    a, b, _ = entries["transformer_blocks.0.attn1.to_q"]
    w0 = base.transformer.state_dict()["transformer_blocks.0.attn1.to_q.weight"]
    torch.testing.assert_close(fused.transformer.state_dict()["transformer_blocks.0.attn1.to_q.weight"],
                               w0 + 0.7 * (b @ a))


def test_lora_kohya_naming_with_alpha_equals_scaled_peft_naming(ckpt, tmp_path):
    base = load_ltx_model(TransformerPlan(ckpt["2.3"], dtype="fp32"))
    entries = _lora_entries(base, rank=4)
    peft, kohya = tmp_path / "peft.safetensors", tmp_path / "kohya.safetensors"
    _write_lora(peft, entries)
    _write_lora(kohya, {m: (a, b, 2.0) for m, (a, b, _) in entries.items()}, form="kohya")  # alpha/rank = 0.5
    one = load_ltx_model(TransformerPlan(ckpt["2.3"], dtype="fp32", loras=[(str(peft), 0.5)]))
    two = load_ltx_model(TransformerPlan(ckpt["2.3"], dtype="fp32", loras=[(str(kohya), 1.0)]))
    _assert_equal(_outputs(one, "2.3"), _outputs(two, "2.3"))


def test_lora_with_foreign_keys_is_rejected(ckpt, tmp_path):
    bad = tmp_path / "sdxl_lora.safetensors"
    save_file({"lora_unet_input_blocks_1_1_proj_in.lora_down.weight": torch.zeros(2, 4),
               "lora_unet_input_blocks_1_1_proj_in.lora_up.weight": torch.zeros(4, 2)}, str(bad))
    with pytest.raises(CheckpointError, match="match no weight of this LTX-2 transformer.*input_blocks"):
        load_ltx_model(TransformerPlan(ckpt["2.3"], dtype="fp32", loras=[(str(bad), 1.0)]))
    with pytest.raises(CheckpointError, match="no LoRA file"):
        load_ltx_model(TransformerPlan(ckpt["2.3"], dtype="fp32", loras=[(str(tmp_path / "missing.safetensors"), 1.0)]))


@pytest.mark.parametrize("tokens", [9, 1100])
def test_connector_registers_follow_comfyui_layout(ckpt, tokens):
    """ComfyUI: ``cat(x, tile(registers)[T:L])`` with L = 128 * ceil(max(1024, T) / 128), RoPE
    over positions 0..L-1, the blocks without a mask, a final RMS norm."""
    conn = load_ltx_model(TransformerPlan(ckpt["2.3"], dtype="fp32")).video_connector
    x = torch.randn(1, tokens, conn.inner_dim, generator=torch.Generator().manual_seed(0))
    out = run_connector(conn, x)
    length = 128 * -(-max(1024, tokens) // 128)
    assert out.shape == (1, length, conn.inner_dim)
    regs = conn.learnable_registers.float().tile(length // 128, 1)
    h = torch.cat([x, regs[tokens:].unsqueeze(0)], dim=1)
    pe = precompute_freqs_cis(torch.arange(length, dtype=F32)[None, None], dim=conn.inner_dim, out_dtype=F32,
                              theta=10000.0, max_pos=[4096], num_attention_heads=conn.num_attention_heads,
                              rope_type=conn.rope_type, freq_grid_generator=generate_freq_grid_np)
    with torch.no_grad():
        for block in conn.transformer_1d_blocks:
            h = block(h, attention_mask=None, pe=pe)
        ref = rms_norm(h)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_the_connectors_of_another_file_serve_a_transformer_file_without_them(ckpt, version, tmp_path):
    """LTX-2.0's GGUF transformers ship without the text connectors, which come in ComfyUI's
    embeddings-connector file (the connectors under ``model.diffusion_model.`` beside the text
    projection): a plan naming that file (or the full checkpoint) loads them, and the model is the
    full checkpoint's; a file without connectors is refused naming the fix."""
    from ltx_mgpu.assets.ggml_export import export_gguf

    ref = _outputs(load_ltx_model(TransformerPlan(ckpt[version], dtype="fp32")), version)
    full = load_file(str(ckpt[version]))
    prefix = "model.diffusion_model."
    connectors = ("video_embeddings_connector.", "audio_embeddings_connector.")
    bare = {k[len(prefix):]: v for k, v in full.items()
            if k.startswith(prefix) and not k[len(prefix):].startswith(connectors)}
    with safe_open(str(ckpt[version]), "pt") as f:
        meta = f.metadata()
    src = tmp_path / "bare.safetensors"
    save_file(bare, str(src), metadata={"config": meta["config"]})
    gguf = export_gguf(src, tmp_path / "bare-F16.gguf", lambda key, shape: "F32")  # as a GGUF, like the 2.0 files
    embeddings = tmp_path / "ltx-2-embeddings_connector.safetensors"
    save_file({k: v for k, v in full.items() if k.startswith(tuple(prefix + c for c in connectors))
               or k.startswith("text_embedding_projection.")}, str(embeddings))
    without = load_ltx_model(TransformerPlan(gguf, dtype="fp32"))
    assert without.video_connector is None and without.audio_connector is None
    for source in (embeddings, ckpt[version]):
        model = load_ltx_model(TransformerPlan(gguf, dtype="fp32", connectors=source))
        assert model.plan.connectors == str(source)
        _assert_equal(ref, _outputs(model, version))
    with pytest.raises(CheckpointError, match="holds no LTX-2 text connectors .* give the LTX-2 checkpoint or the "
                                              "embeddings-connector file"):
        load_ltx_model(TransformerPlan(gguf, dtype="fp32", connectors=src))
    with pytest.raises(FileNotFoundError, match="no connectors file at"):
        load_ltx_model(TransformerPlan(gguf, dtype="fp32", connectors=tmp_path / "missing.safetensors"))


@pytest.mark.parametrize("version", ["2.0", "2.3"])
def test_the_attention_normalises_queries_and_keys_with_comfyuis_epsilon(ckpt, version):
    """ComfyUI's ``CrossAttention`` (blocks and connectors): ``RMSNorm(eps=1e-5)``; ltx-core builds
    them with the config's ``norm_eps`` (1e-6), which every other norm keeps (ComfyUI's there too)."""
    model = load_ltx_model(TransformerPlan(ckpt[version], dtype="fp32"))
    for module in (model.transformer, model.video_connector, model.audio_connector):
        attentions = [m for m in module.modules() if isinstance(m, Attention)]
        assert attentions and {(m.q_norm.eps, m.k_norm.eps) for m in attentions} == {(COMFY_QK_NORM_EPS,) * 2}
    assert {b.norm_eps for b in model.transformer.transformer_blocks} == {1e-6}
    assert model.transformer.norm_out.eps == model.transformer.audio_norm_out.eps == 1e-6
    q = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0)) * 1e-2
    norm = model.transformer.transformer_blocks[0].attn1.q_norm
    torch.testing.assert_close(norm(q), torch.nn.functional.rms_norm(q, (32,), norm.weight, 1e-5), rtol=0, atol=0)


@pytest.mark.parametrize("value, match", [
    ("[" * 100_000, r"the 'config' metadata is not JSON \(RecursionError"),
    (json.dumps({"transformer": 5}), r"the 'config' metadata's 'transformer' is a int, not an object"),
    (json.dumps({"x": "y" * (90 << 20)}), r"the 'config' metadata is 94371849 bytes, more than 1048576"),
], ids=["deep", "not_an_object", "90_mb"])
def test_a_malformed_config_in_the_header_is_refused_naming_it(tiny_ltx_23, tmp_path, value, match):
    sd = load_file(str(tiny_ltx_23))
    bad = tmp_path / "bad.safetensors"
    save_file(sd, str(bad), metadata={"config": value})
    with pytest.raises(CheckpointError, match=match) as e:
        inspect_checkpoint(bad)
    assert str(bad) in str(e.value)
