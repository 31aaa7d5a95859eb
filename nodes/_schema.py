"""A stand-in for ComfyUI's typed node schema (``comfy_api.latest``: ``io`` and ``ComfyExtension``)
for when the pack is imported without ComfyUI: tests, the CLI, a broken install.

The pack's nodes are declared on ComfyUI's V3 schema (``io.ComfyNode``, ``define_schema``,
``io.NodeOutput``), as ComfyUI's own LTX nodes are (``comfy_extras/nodes_lt.py``). Inside ComfyUI
they use ComfyUI's classes (:data:`nodes._comfy.io`). Outside it, this module gives the same names
for the part of the API the pack uses, holding the declarations as data (ids, types, options,
defaults, tooltips) and running nothing of ComfyUI's: no widget checks, no V1 conversion, no
caching. ``tests/comfyui/test_comfyui_real.py`` compares each node's schema here with ComfyUI's own
reading of it (``/object_info``), so the two cannot drift apart unseen.

The constructors take ComfyUI 0.20.1's keyword names (``comfy_api/latest/_io.py``); an option this
stand-in does not know is an error (``TypeError``), so a declaration that ComfyUI would reject
does not pass here silently.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ComfyExtension", "ComfyNode", "Hidden", "NodeOutput", "Schema", "Boolean", "Clip", "Combo",
           "Conditioning", "Custom", "Float", "Int", "Latent", "Model", "Sigmas", "String", "Vae"]


class Hidden(str, enum.Enum):
    """The hidden inputs a node may ask for (ComfyUI's ``io.Hidden``)."""

    unique_id = "UNIQUE_ID"
    prompt = "PROMPT"
    extra_pnginfo = "EXTRA_PNGINFO"


class _Input:
    """One input: ``id``, its ComfyUI type (``io_type``), ``optional``, ``tooltip`` and the
    widget options of its type (``default``, ``min``, ``max``, ``options``...) as attributes."""

    io_type = ""
    _OPTIONS: tuple[str, ...] = ()

    def __init__(self, id: str, display_name: str | None = None, optional: bool = False,  # noqa: A002 - ComfyUI's
                 tooltip: str | None = None, **options: Any):
        unknown = sorted(set(options) - set(self._OPTIONS))
        if unknown:
            raise TypeError(f"{type(self).__qualname__} takes no option(s) {unknown}")
        self.id, self.display_name, self.optional, self.tooltip = id, display_name, optional, tooltip
        for name in self._OPTIONS:  # each option an attribute, None when not given (as ComfyUI's)
            setattr(self, name, options.get(name))


class _Output:
    """One output: ``id``, ``display_name`` (the id when not given, as ComfyUI names it), ``tooltip``."""

    io_type = ""

    def __init__(self, id: str | None = None, display_name: str | None = None,  # noqa: A002 - ComfyUI's
                 tooltip: str | None = None, is_output_list: bool = False):
        self.id, self.display_name, self.tooltip = id, display_name or id, tooltip
        self.is_output_list = is_output_list


def _comfy_type(io_type: str, options: tuple[str, ...] = ()) -> type:
    """A type of ComfyUI's schema: ``.Input(...)`` and ``.Output(...)`` of ``io_type``."""
    input_cls = type("Input", (_Input,), {"io_type": io_type, "_OPTIONS": options})
    output_cls = type("Output", (_Output,), {"io_type": io_type})
    return type(io_type.title(), (), {"io_type": io_type, "Input": input_cls, "Output": output_cls})


_WIDGET = ("default", "socketless", "force_input", "lazy", "advanced", "raw_link", "extra_dict")
Boolean = _comfy_type("BOOLEAN", _WIDGET + ("label_on", "label_off"))
Int = _comfy_type("INT", _WIDGET + ("min", "max", "step", "control_after_generate", "display_mode"))
Float = _comfy_type("FLOAT", _WIDGET + ("min", "max", "step", "round", "display_mode"))
String = _comfy_type("STRING", _WIDGET + ("multiline", "placeholder", "dynamic_prompts"))
Combo = _comfy_type("COMBO", _WIDGET + ("options", "control_after_generate", "upload", "image_folder", "remote"))
Latent = _comfy_type("LATENT", ("lazy", "raw_link", "advanced"))
Conditioning = _comfy_type("CONDITIONING", ("lazy", "raw_link", "advanced"))
Sigmas = _comfy_type("SIGMAS", ("lazy", "raw_link", "advanced"))
Model = _comfy_type("MODEL", ("lazy", "raw_link", "advanced"))
Clip = _comfy_type("CLIP", ("lazy", "raw_link", "advanced"))
Vae = _comfy_type("VAE", ("lazy", "raw_link", "advanced"))


def Custom(io_type: str) -> type:  # noqa: N802 - ComfyUI's name
    """A custom type (ComfyUI's ``io.Custom``): the pack's own ``LTXMGPU_*`` types."""
    return _comfy_type(io_type, ("lazy", "raw_link", "advanced"))


@dataclass
class Schema:
    """A node's declaration (ComfyUI's ``io.Schema``, the fields the pack uses)."""

    node_id: str
    display_name: str | None = None
    category: str = "sd"
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    description: str = ""
    search_aliases: list = field(default_factory=list)
    is_output_node: bool = False
    not_idempotent: bool = False


class NodeOutput:
    """What a node returns (ComfyUI's ``io.NodeOutput``): the outputs in order, and ``ui``."""

    def __init__(self, *args: Any, ui: Any = None, expand: Any = None, block_execution: str | None = None):
        self.args, self.ui, self.expand, self.block_execution = args, ui, expand, block_execution

    @property
    def result(self) -> tuple | None:
        return self.args if self.args else None

    def __getitem__(self, index: int) -> Any:
        return self.args[index]


class ComfyNode:
    """The base of a node (ComfyUI's ``io.ComfyNode``). ``hidden`` holds the hidden inputs of the
    execution (None here: ComfyUI sets it on a copy of the class for each execution)."""

    hidden: Any = None

    @classmethod
    def define_schema(cls) -> Schema:
        raise NotImplementedError

    @classmethod
    def execute(cls, **kwargs: Any) -> NodeOutput:
        raise NotImplementedError


class ComfyExtension:
    """A pack's entry for ComfyUI (``comfy_entrypoint()`` returns one)."""

    async def on_load(self) -> None:
        """Called when ComfyUI loads the pack."""

    async def get_node_list(self) -> list[type[ComfyNode]]:
        raise NotImplementedError
