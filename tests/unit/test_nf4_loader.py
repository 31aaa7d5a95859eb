"""NF4 Gemma 3 (ltx_mgpu.text.nf4.quantize) through the loaders: dispatch on the source and bad
arguments, an embedding cache that never mixes NF4 and bf16, and the CLI's quantize-nf4 then
encode."""

from __future__ import annotations

import filecmp

import pytest
import torch
from nf4_support import LONG

from ltx_mgpu.text.cache.keys import cache_key_parts, weights_mode
from ltx_mgpu.text.config import TextEncoderConfig
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.gemma.sources import GemmaFormatError
from ltx_mgpu.text.nf4.load import load_nf4
from ltx_mgpu.text.nf4.quantize import quantize_nf4, save_nf4

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
    from ltx_mgpu.text.cache.keys import cache_key
    from ltx_mgpu.text.cache.store import EmbeddingCache
    from ltx_mgpu.text.encoder.local import LocalTextEncoder

    specs = {
        "bf16": LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, weights="bf16")),
        "nf4": LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, weights="nf4")),
        "artifact": LocalTextEncoder(TextEncoderConfig(artifact, tiny_ltx_23)),  # weights="bf16" asked, NF4 loaded
        "artifact-nf4": LocalTextEncoder(TextEncoderConfig(artifact, tiny_ltx_23, weights="nf4")),
    }
    parts = {k: cache_key_parts(s.config) for k, s in specs.items()}
    assert [parts[k].weights_mode for k in specs] == ["bf16", "nf4", "nf4", "nf4"]
    keys = {k: cache_key("the cat", p) for k, p in parts.items()}
    assert len({keys["bf16"], keys["nf4"], keys["artifact"]}) == 3 and keys["artifact"] == keys["artifact-nf4"]

    cache = EmbeddingCache(tmp_path / "cache")
    prompts = ["the cat", LONG]
    got = {}
    for name in ("bf16", "nf4", "artifact"):
        got[name], report = specs[name].encode(prompts, cache=cache)
        assert (report.hits, report.encoded) == (0, 2), name  # never served another mode's entry
        assert specs[name].build().tower.weights == weights_mode(specs[name].config)
    again, report = LocalTextEncoder(TextEncoderConfig(artifact, tiny_ltx_23)).encode(prompts, cache=cache)
    assert report.hits == 2 and all(torch.equal(a.tensor, b.tensor) for a, b in zip(again, got["artifact"]))
    for a, b, c in zip(got["nf4"], got["artifact"], got["bf16"]):
        assert torch.equal(a.tensor, b.tensor)  # same NF4 bytes -> same embedding
        assert not torch.equal(a.tensor, c.tensor)


def test_cli_quantize_then_encode(tiny_gemma_dir, tiny_ltx_23, tmp_path, capsys):
    from ltx_mgpu.cli.main import main
    from ltx_mgpu.text.embedding_files import load_embeddings

    out = tmp_path / "cli-nf4"
    assert main(["quantize-nf4", str(tiny_gemma_dir), str(out), "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert f"wrote NF4 artifact {out}" in text and "peak RSS" in text and "42 NF4 projection weights" in text
    assert f"encode --gemma {out} --projection" in text  # the hint gives a command that runs
    assert main(["quantize-nf4", str(tiny_gemma_dir), str(out)]) == 2
    assert "already exists; pass a new directory" in capsys.readouterr().err
    (tmp_path / "afile").write_text("")
    assert main(["quantize-nf4", str(tiny_gemma_dir), str(tmp_path / "afile" / "nf4")]) == 2
    assert "afile is a file, not a directory" in capsys.readouterr().err
    emb = tmp_path / "e.safetensors"
    assert main(["encode", "--gemma", str(out), "--projection", str(tiny_ltx_23), "--prompt", "the cat",
                 "--out", str(emb), "--no-cache"]) == 0
    ref = load_gemma_text_tower(tiny_gemma_dir, weights="nf4")
    from ltx_mgpu.text.encoder.prompt import PromptEncoder
    from ltx_mgpu.text.features import load_projection

    enc = PromptEncoder(ref, load_projection(tiny_ltx_23, dtype=torch.float32, num_layers=ref.num_hidden_states))
    assert torch.equal(load_embeddings(emb)[1][0].tensor, enc.encode(["the cat"])[0].tensor)
