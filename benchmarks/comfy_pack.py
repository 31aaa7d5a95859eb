"""This repository loaded into a process that has imported ComfyUI, as ComfyUI loads a custom
node: the package under another name (``ltx_mgpu_pack``), so its ``nodes`` does not shadow
ComfyUI's ``nodes`` module. The benchmarks and tests that drive ComfyUI in-process share it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

__all__ = ["PACK", "REPO", "load_pack"]

#: The repository root (the pack's folder, as it sits under ComfyUI's ``custom_nodes``).
REPO = Path(__file__).resolve().parents[1]
#: The name the pack is imported under.
PACK = "ltx_mgpu_pack"


def load_pack() -> dict:
    """Import the pack (once per process) and return its nodes by id (what its
    ``comfy_entrypoint`` gives ComfyUI). Call it after ComfyUI's modules are importable."""
    pack = sys.modules.get(PACK)
    if pack is None:
        spec = importlib.util.spec_from_file_location(PACK, REPO / "__init__.py",
                                                      submodule_search_locations=[str(REPO)])
        pack = importlib.util.module_from_spec(spec)
        sys.modules[PACK] = pack
        spec.loader.exec_module(pack)
    return dict(pack.NODES)
