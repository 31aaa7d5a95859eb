"""Helpers shared by the node tests: the pack imported the way ComfyUI imports it (its node
classes and bridge modules), an audio-video latent, and ComfyUI-like model folders."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
from pool_support import cleanup, short_dir
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
PACK = "ltx_mgpu_pack_under_test"


def load_pack():
    """Import the pack the way ComfyUI does (a file location under a mangled module name)."""
    if PACK in sys.modules:
        return sys.modules[PACK]
    spec = importlib.util.spec_from_file_location(PACK, REPO / "__init__.py", submodule_search_locations=[str(REPO)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACK] = module
    spec.loader.exec_module(module)
    return module


PACK_MODULE = load_pack()
NODES = PACK_MODULE.NODES
bridge = sys.modules[f"{PACK}.nodes._comfy"]
runtime = sys.modules[f"{PACK}.nodes._runtime"]
routes = sys.modules[f"{PACK}.nodes.routes"]
denoise_nodes = sys.modules[f"{PACK}.nodes.denoise"]


def node(name):
    """The class of node ``name``."""
    return NODES[name]


def run(name, *args, unique_id=None, **kwargs):
    """Execute node ``name`` as ComfyUI does: ``execute`` on a copy of its class that holds the
    execution's hidden inputs (``unique_id``); returns its ``NodeOutput``."""
    cls = NODES[name]
    clone = type(cls.__name__, (cls,), {"hidden": types.SimpleNamespace(unique_id=unique_id)})
    return clone.execute(*args, **kwargs)


class DuckNested:
    """A NestedTensor-shaped object that is not the bridge's class (as another pack might pass)."""

    is_nested = True

    def __init__(self, tensors):
        self.tensors = list(tensors)


def av_latent(nested=DuckNested, seed=11):
    g = torch.Generator().manual_seed(seed)
    video, audio = torch.randn(1, 128, 2, 2, 3, generator=g), torch.randn(1, 8, 5, 16, generator=g)
    vmask, amask = torch.ones(1, 1, 2, 1, 1), torch.ones(1, 1, 5, 1)
    vmask[:, :, 0] = 0.0
    return {"samples": nested([video, audio]), "noise_mask": nested([vmask, amask]), "type": "audio", "kept": "yes"}


@contextlib.contextmanager
def model_folders(tmp_path_factory, tiny_gemma_dir, tiny_gemma_comfy_file, tiny_ltx_23):
    """ComfyUI-like model folders ($LTX_MGPU_MODELS_DIR), a private pool runtime dir and cache."""
    models = tmp_path_factory.mktemp("models")
    for folder in ("checkpoints", "text_encoders", "loras", "diffusion_models"):
        (models / folder).mkdir()
    (models / "checkpoints" / "tiny-ltx-2.3.safetensors").symlink_to(tiny_ltx_23)
    (models / "text_encoders" / "tiny-gemma").symlink_to(tiny_gemma_dir, target_is_directory=True)
    (models / "text_encoders" / "tiny-gemma-comfy.safetensors").symlink_to(tiny_gemma_comfy_file)
    save_file({"diffusion_model.x.lora_A.weight": torch.zeros(2, 2)}, str(models / "loras" / "style.safetensors"))
    base = short_dir()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LTX_MGPU_MODELS_DIR", str(models))
        mp.setenv("LTX_MGPU_RUNTIME_DIR", str(base))
        mp.setenv("LTX_MGPU_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield models
    cleanup(base)


@contextlib.contextmanager
def cpu_pool(ranks: int = 2):
    """A Pool node's handle on ``ranks`` CPU ranks; the pool is shut down on leaving."""
    handle = run("LTXMGPU_Pool", "cpu", ranks, "with-owner", True)[0]
    try:
        yield handle
    finally:
        handle.client.shutdown()


class NoPool:
    """A PoolHandle whose session fails on any use: an encode that needs the pool raises."""

    def session(self):
        return self

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AssertionError(f"the pool was contacted ({name}); the prompt should have come from the cache")
