"""Gemma 3 GGUF files (``ltx_mgpu.text.gemma.gguf_file``): the tiny Gemma written as llama.cpp
writes Gemma 3 (its linears and embedding in Q8_0 / Q4_0, norms plus one, its tokenizer's
pieces) loads with those layers kept packed and computes what the same values dequantized into
the snapshot's model compute (fp32, 1e-6); its tokenizer rebuilt from the GGUF gives the
snapshot's ids; the prompt cache tells the file apart from the snapshot; what cannot be read is
refused naming the fix. The real Gemma 3 270M GGUF: ``tests/integration/test_gemma_270m.py``."""

from __future__ import annotations

import gguf
import pytest
import torch

from ltx_mgpu.assets.ggml_export import export_gemma_gguf
from ltx_mgpu.quantized.ggml import GGUFFile, dequantize
from ltx_mgpu.quantized.packed import PackedEmbedding, PackedLinear
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.gemma.forward import run_tower
from ltx_mgpu.text.gemma.sources import (
    GemmaFormatError,
    GemmaWeightsError,
    detect_gemma_format,
    gemma_identity,
    gemma_source_files,
)

PROMPTS = ["a red fox running through snow at dawn", "two  spaces\tand a tab, 123 digits", "water"]


@pytest.fixture(scope="module", params=["Q8_0", "Q4_0"])
def gemma_gguf(request, tiny_gemma_dir, tmp_path_factory):
    return export_gemma_gguf(tiny_gemma_dir, tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf",
                             request.param)


def _reference(snapshot, gguf_path):
    """The snapshot's tower (float32) with every weight set to the GGUF file's values."""
    tower = load_gemma_text_tower(snapshot, dtype=torch.float32)
    f = GGUFFile(gguf_path)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, tower.config.num_hidden_layers)
    with torch.no_grad():
        for key, p in tower.model.named_parameters():
            stem, _, suffix = key.rpartition(".")
            t = f.tensors[f"{table.get_name('model.' + stem)}.{suffix}"]
            values = dequantize(f.read(t.name), t.qtype, t.shape)
            p.copy_(values - 1.0 if key.endswith("norm.weight") else values)
    return tower


def test_a_gguf_gemma_keeps_its_blocks_packed_and_computes_what_its_values_compute(tiny_gemma_dir, gemma_gguf):
    assert detect_gemma_format(gemma_gguf) == "gguf_file"
    tower = load_gemma_text_tower(gemma_gguf, dtype=torch.float32)
    assert tower.format == "gguf_file" and tower.config.num_hidden_layers == 6
    layers = [m for m in tower.model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 6 * 7 and isinstance(tower.model.embed_tokens, PackedEmbedding)
    reference = _reference(tiny_gemma_dir, gemma_gguf)
    assert tower.config.rope_parameters == reference.config.rope_parameters  # linear x8 on global layers
    assert tower.config.layer_types == reference.config.layer_types
    enc = tower.tokenizer(PROMPTS, padding=True, return_tensors="pt")
    ref = reference.tokenizer(PROMPTS, padding=True, return_tensors="pt")
    assert torch.equal(enc["input_ids"], ref["input_ids"])  # the GGUF's vocabulary is the tokenizer
    with torch.no_grad():
        got = run_tower(tower, enc["input_ids"], enc["attention_mask"]).hidden_states
        want = run_tower(reference, ref["input_ids"], ref["attention_mask"]).hidden_states
    for g, w in zip(got, want, strict=True):
        assert float((g - w).norm() / w.norm()) <= 1e-6


def test_the_prompt_cache_tells_a_gguf_gemma_from_its_snapshot(tiny_gemma_dir, gemma_gguf):
    assert gemma_source_files(gemma_gguf) == (gemma_gguf,)  # the vocabulary is inside
    assert gemma_identity(gemma_gguf) != gemma_identity(tiny_gemma_dir)


def test_what_a_gguf_gemma_loader_cannot_read_is_refused_naming_the_fix(tiny_gemma_dir, gemma_gguf, tmp_path):
    with pytest.raises(ValueError, match="is a GGUF file, already quantized: choose weights 'bf16'"):
        load_gemma_text_tower(gemma_gguf, weights="nf4")
    ltx = tmp_path / "ltx.gguf"
    writer = gguf.GGUFWriter(str(ltx), "ltxv")
    writer.add_tensor("x.weight", torch.zeros(2, 32).numpy())
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    with pytest.raises(GemmaFormatError, match="architecture 'ltxv' .an LTX-2 transformer: load it with the Model"):
        detect_gemma_format(ltx)
    iq4 = tmp_path / "iq4.gguf"
    writer = gguf.GGUFWriter(str(iq4), "gemma3")
    writer.add_tensor("blk.0.attn_q.weight", torch.zeros(64, 136, dtype=torch.uint8).numpy(),
                      raw_dtype=gguf.GGMLQuantizationType.IQ4_XS)
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                 writer.close):
        step()
    with pytest.raises(GemmaFormatError, match="tensor blk.0.attn_q.weight is IQ4_XS, which ltx_mgpu does not read"):
        load_gemma_text_tower(iq4)
    # one poisoned Q8_0/Q4_0 block scale (fp16 NaN) is refused naming the tensor
    bad = tmp_path / "nan.gguf"
    bad.write_bytes(gemma_gguf.read_bytes())
    tensor = next(t for t in gguf.GGUFReader(str(bad)).tensors if t.name == "blk.2.attn_v.weight")
    raw = bytearray(bad.read_bytes())
    raw[tensor.data_offset:tensor.data_offset + 2] = b"\x00\x7e"
    bad.write_bytes(bytes(raw))
    with pytest.raises(GemmaWeightsError, match="tensor blk.2.attn_v.weight holds NaN or infinite values"):
        load_gemma_text_tower(bad)
