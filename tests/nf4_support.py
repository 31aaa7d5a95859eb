"""Helpers shared by the NF4 tests: the prompts, the tiny Gemma quantized to an NF4 artifact, and
a tower's hidden states."""

from __future__ import annotations

from pathlib import Path

from ltx_mgpu.text.nf4 import quantize_nf4
from gemma_support import hidden as gemma_hidden

LONG = "a red camera walks slowly through the city at night while the rain falls and music plays"
PROMPTS = ["the cat", LONG, LONG + " " + LONG, ""]


def quantize_tiny(tiny_gemma_dir: Path, tmp_path_factory) -> Path:
    """The tiny Gemma quantized on the CPU into a fresh temporary NF4 artifact."""
    return quantize_nf4(tiny_gemma_dir, tmp_path_factory.mktemp("nf4") / "tiny-nf4", device="cpu")


def hidden(tower, prompts=PROMPTS):
    """``(hidden states, attention mask)`` of ``prompts`` (default: the NF4 tests' own)."""
    return gemma_hidden(tower, prompts)
