"""ComfyUI entry point of the LTX-2 Multi-GPU node pack (ComfyUI's V3 extension: ``comfy_entrypoint``).

ComfyUI imports this folder under a mangled module name, so the engine package
``ltx_mgpu`` (which the pool's worker processes also import with ``python -m``) is made
importable by putting this folder on ``sys.path``. Importing works with and without
ComfyUI: only ``nodes/_comfy.py`` touches ComfyUI, each access with a fallback.
"""

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from .nodes import NODES, comfy_entrypoint  # noqa: E402

WEB_DIRECTORY = "./web"

__all__ = ["NODES", "WEB_DIRECTORY", "comfy_entrypoint"]
