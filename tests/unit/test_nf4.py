"""NF4 Gemma 3 (ltx_mgpu.text.nf4.quantize) artifacts: the round trip (quantize -> load equals the
on-the-fly path, byte for byte), contents and manifest, damage detection, and size."""

from __future__ import annotations

import filecmp
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from nf4_support import PROMPTS, hidden
from safetensors.torch import load_file, save_file

from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.gemma.sources import NF4_MANIFEST, GemmaFormatError, detect_gemma_format, gemma_identity
from ltx_mgpu.text.gemma.tokenizer import tokenize
from ltx_mgpu.text.nf4.artifact import PROJECTIONS, NF4ArtifactError, artifact_bytes, read_manifest
from ltx_mgpu.text.nf4.load import NonFiniteHiddenStatesError, load_nf4, load_nf4_on_the_fly
from ltx_mgpu.text.nf4.model import nf4_linears
from ltx_mgpu.text.nf4.quantize import quantize_nf4


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
            "tensors": {k: {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                        for k, v in tensors.items()},
        }
        (artifact / NF4_MANIFEST).write_text(json.dumps(manifest))


# --------------------------------------------------------------------------- round trip


def test_quantize_load_equals_on_the_fly(tiny_gemma_dir, artifact, nf4_tower, tmp_path):
    otf = load_nf4_on_the_fly(tiny_gemma_dir, save_to=tmp_path / "saved")
    assert (otf.weights, otf.format, nf4_tower.weights, nf4_tower.format) == ("nf4", "hf_snapshot", "nf4",
                                                                              "nf4_artifact")
    # same bytes: every tensor, and the artifact saved on the fly is file-for-file identical
    a, b = _quant_tensors(nf4_tower), _quant_tensors(otf)
    assert a.keys() == b.keys() and len([k for k in a if k.endswith(".weight.absmax")]) == 6 * len(PROJECTIONS)
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert sorted(p.name for p in artifact.iterdir()) == sorted(p.name for p in (tmp_path / "saved").iterdir())
    for f in artifact.iterdir():
        assert filecmp.cmp(f, tmp_path / "saved" / f.name, shallow=False), f.name
    # same outputs
    h_art, mask = hidden(nf4_tower)
    h_otf, _ = hidden(otf)
    assert all(torch.equal(x, y) for x, y in zip(h_art, h_otf))
    assert mask.sum(1).max() > 2 * nf4_tower.config.sliding_window and (mask == 0).any()


def test_in_memory_model_quantizes_to_the_same_bytes(bf16_tower, tiny_gemma_dir, artifact, tmp_path):
    from ltx_mgpu.text.nf4.quantize import quantize_nf4_model

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
    assert (q["quant_type"], q["blocksize"], q["double_quant"], q["compute_dtype"], q["device"]) == ("nf4", 64, True,
                                                                                                     "bfloat16", "cpu")
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
        assert (m.compute_dtype, qs.quant_type, qs.nested, qs.blocksize, qs.dtype) == (torch.bfloat16, "nf4", True, 64,
                                                                                       torch.bfloat16)
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
    from ltx_mgpu.text.nf4.artifact import write_artifact
    from ltx_mgpu.text.nf4.model import skeleton
    from ltx_mgpu.text.nf4.source import iter_source, open_source

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


def test_quantize_onto_a_full_disk_says_how_much_it_needs_and_leaves_nothing(tiny_gemma_dir, tmp_path, monkeypatch,
                                                                             capsys):
    """Issue 29, finding 14: ``quantize-nf4`` onto a full disk ended in a raw ``SafetensorError``
    traceback. A disk with less free space than the artifact needs is refused before anything
    is written; one that fills up meanwhile (safetensors' own error as it reports ENOSPC) gets
    the same one line; nothing partial is left either way."""
    import errno as errnos

    from safetensors import SafetensorError

    from ltx_mgpu.cli.main import main
    from ltx_mgpu.text.nf4 import artifact
    from ltx_mgpu.text.nf4.model import skeleton
    from ltx_mgpu.text.nf4.source import open_source

    need = artifact.estimated_bytes(skeleton(open_source(tiny_gemma_dir).config)[1])
    out = tmp_path / "disk" / "nf4"
    real_usage = shutil.disk_usage
    monkeypatch.setattr(artifact.shutil, "disk_usage", lambda p: real_usage(p)._replace(free=need - 1))
    with pytest.raises(OSError, match=rf"no space left on {tmp_path / 'disk'}: the NF4 artifact needs "
                                      rf"{need / 1e9:.2f} GB, {(need - 1) / 1e9:.2f} GB free") as err:
        quantize_nf4(tiny_gemma_dir, out, device="cpu")
    assert err.value.errno == errnos.ENOSPC and list((tmp_path / "disk").iterdir()) == []
    monkeypatch.setattr(artifact.shutil, "disk_usage", real_usage)

    def full_disk(tensors, path, metadata=None):  # writes part of a shard, then the disk is full
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(artifact, "save_file", full_disk)
    rc = main(["quantize-nf4", str(tiny_gemma_dir), str(out), "--device", "cpu"])
    err_text = capsys.readouterr().err
    assert rc == 1 and err_text.strip().splitlines() == [
        f"error: no space left on {tmp_path / 'disk'}: the NF4 artifact needs {need / 1e9:.2f} GB; free some space "
        "or give an OUT_DIR on another disk"]
    assert list((tmp_path / "disk").iterdir()) == []  # no partial artifact, no temporary directory


def test_the_size_estimate_covers_what_quantize_writes(tiny_gemma_dir, tmp_path):
    from ltx_mgpu.text.nf4 import artifact
    from ltx_mgpu.text.nf4.model import skeleton
    from ltx_mgpu.text.nf4.source import open_source

    out = quantize_nf4(tiny_gemma_dir, tmp_path / "nf4", device="cpu")
    need = artifact.estimated_bytes(skeleton(open_source(tiny_gemma_dir).config)[1])
    written = sum(p.stat().st_size for p in out.iterdir())
    assert written <= need <= written + artifact.OVERHEAD_BYTES


def test_artifact_size_matches_parameter_counts(tiny_gemma_dir, tmp_path):
    """Size = packed 4-bit (N*K/2 B) + double-quant scales (N*K/64 B uint8 + 4 B per 256 blocks)
    + bf16 residents (2 B each), within 5 %. Per-tensor overheads (code tables, JSON, safetensors
    headers, manifest, tokenizer) are what the 5 % covers; on the 64-wide tiny model they are
    ~40 %, so this uses a 256-wide 2-layer model (text-only layout, tied lm_head not stored)."""
    from transformers import Gemma3ForCausalLM

    from ltx_mgpu.text.gemma.sources import gemma3_text_config

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
