"""Helpers shared by the NF4 tests: the prompts, the tiny Gemma quantized to an NF4 artifact, and
a tower's hidden states."""

from __future__ import annotations

from pathlib import Path

from ltx_mgpu.text.gemma import encode_hidden_states
from ltx_mgpu.text.nf4 import quantize_nf4
from ltx_mgpu.text.tokenizer import tokenize

LONG = "a red camera walks slowly through the city at night while the rain falls and music plays"
PROMPTS = ["the cat", LONG, LONG + " " + LONG, ""]


def quantize_tiny(tiny_gemma_dir: Path, tmp_path_factory) -> Path:
    """The tiny Gemma quantized on the CPU into a fresh temporary NF4 artifact."""
    return quantize_nf4(tiny_gemma_dir, tmp_path_factory.mktemp("nf4") / "tiny-nf4", device="cpu")


def hidden(tower, prompts=PROMPTS):
    ids, mask, _ = tokenize(tower, prompts)
    return encode_hidden_states(tower, ids, mask), mask
