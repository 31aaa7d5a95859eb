"""Helpers shared by the NF4 tests: the prompts and a tower's hidden states (the NF4 artifact and
towers are fixtures in conftest.py)."""

from __future__ import annotations

from gemma_support import hidden as gemma_hidden

LONG = "a red camera walks slowly through the city at night while the rain falls and music plays"
PROMPTS = ["the cat", LONG, LONG + " " + LONG, ""]


def hidden(tower, prompts=PROMPTS):
    """``(hidden states, attention mask)`` of ``prompts`` (default: the NF4 tests' own)."""
    return gemma_hidden(tower, prompts)
