"""The pack's ComfyUI nodes (one module per node family; ids prefixed ``LTXMGPU``).

Nodes are thin: they validate inputs, call ``ltx_mgpu.client.pool_client`` and convert types. The
mappings below are assembled from every node module listed in ``_MODULES``.
"""

from __future__ import annotations

import importlib

_MODULES: tuple[str, ...] = ("pool", "text", "denoise")

NODE_CLASS_MAPPINGS: dict[str, type] = {}
NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {}

for _name in _MODULES:
    _mod = importlib.import_module(f"{__name__}.{_name}")
    NODE_CLASS_MAPPINGS.update(_mod.NODE_CLASS_MAPPINGS)
    NODE_DISPLAY_NAME_MAPPINGS.update(_mod.NODE_DISPLAY_NAME_MAPPINGS)

# GET /ltx_mgpu/status and POST /ltx_mgpu/free on ComfyUI's server (only when it exists).
from . import routes as _routes  # noqa: E402

_routes.register()
