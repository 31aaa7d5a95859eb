"""The pack's ComfyUI nodes (one module per node family; ids prefixed ``LTXMGPU``), declared on
ComfyUI's typed node schema (``comfy_api.latest.io``, or its stand-in :mod:`nodes._schema`
without ComfyUI).

Nodes are thin: they declare their inputs, call ``ltx_mgpu.client`` and convert types.
:data:`NODES` maps every node id to its class (assembled from the modules in ``_MODULES``);
:func:`comfy_entrypoint` is what ComfyUI loads (a ``ComfyExtension`` listing them).
"""

from __future__ import annotations

import importlib

from ._comfy import ComfyExtension

_MODULES: tuple[str, ...] = ("pool", "text", "denoise")

#: node id -> node class, in the menu's order.
NODES: dict[str, type] = {}
for _name in _MODULES:
    for _cls in importlib.import_module(f"{__name__}.{_name}").NODES:
        NODES[_cls.define_schema().node_id] = _cls


class LTXMultiGPUExtension(ComfyExtension):
    """The pack as ComfyUI's extension: its nodes."""

    async def get_node_list(self) -> list[type]:
        return list(NODES.values())


async def comfy_entrypoint() -> LTXMultiGPUExtension:
    """ComfyUI's entry point of a V3 node pack (``nodes.py``'s ``load_custom_node``)."""
    return LTXMultiGPUExtension()


# GET /ltx_mgpu/status and POST /ltx_mgpu/free on ComfyUI's server (only when it exists).
from . import routes as _routes  # noqa: E402

_routes.register()
