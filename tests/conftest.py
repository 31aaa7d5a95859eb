"""Shared fixtures (the embedded tiny models, built once per test session in a temp dir) and the
order of the tiers: ``unit/`` (one process, fast), the GPU files, ``integration/`` (real pools,
ranks and commands; the real Gemma 3 270M; torch.compile), ``comfyui/`` (a real ComfyUI). The
support modules beside this file are importable from every tier (pytest puts this directory on
``sys.path`` for its conftest)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


#: The tiers in the order they run: a quick failure shows first.
TIERS = ("unit", "", "integration", "comfyui")


def pytest_addoption(parser):
    parser.addoption("--cpu-load", action="store_true",
                     help="run the session with every CPU core kept busy by a busy-loop process (the lifecycle tests "
                          "must pass under load; .ci/run runs them so)")


@pytest.fixture(scope="session", autouse=True)
def _cpu_load(request):
    """With ``--cpu-load``: a busy-loop process per core for the whole session."""
    if not request.config.getoption("--cpu-load"):
        yield
        return
    from pool_support import cpu_load

    with cpu_load():
        yield


def pytest_collection_modifyitems(items):
    """Run the tiers in :data:`TIERS` order (the GPU files, at the top of ``tests/``, after the
    unit tier), each in its collection order."""
    def tier(item) -> int:
        parts = Path(str(item.fspath)).relative_to(TESTS).parts
        return TIERS.index(parts[0] if len(parts) > 1 else "")

    items.sort(key=tier)


@pytest.fixture(scope="session", autouse=True)
def _isolated_home(tmp_path_factory):
    """Keep every test's ltx_mgpu state (digest memo, cache, pools) out of the user's home."""
    home = tmp_path_factory.mktemp("ltx_mgpu_home")
    old = os.environ.get("LTX_MGPU_HOME")
    os.environ["LTX_MGPU_HOME"] = str(home)
    yield home
    if old is None:
        os.environ.pop("LTX_MGPU_HOME", None)
    else:
        os.environ["LTX_MGPU_HOME"] = old


@pytest.fixture(scope="module")
def base():
    """A short private base directory for one test module's pools (a Unix socket path must be
    short), removed with whatever the module left in it."""
    from pool_support import cleanup, short_dir

    b = short_dir()
    yield b
    cleanup(b)


@pytest.fixture(scope="session")
def assets_root(tmp_path_factory):
    return tmp_path_factory.mktemp("assets")


@pytest.fixture(scope="session")
def tiny_gemma_dir(assets_root):
    from ltx_mgpu.assets import tiny_gemma_dir

    return tiny_gemma_dir(assets_root)


@pytest.fixture(scope="session")
def tiny_gemma_comfy_file(assets_root):
    from ltx_mgpu.assets import tiny_gemma_comfy_file

    return tiny_gemma_comfy_file(assets_root)


@pytest.fixture(scope="session")
def tiny_ltx_20(assets_root):
    from ltx_mgpu.assets import tiny_ltx_checkpoint

    return tiny_ltx_checkpoint("2.0", assets_root)


@pytest.fixture(scope="session")
def tiny_ltx_23(assets_root):
    from ltx_mgpu.assets import tiny_ltx_checkpoint

    return tiny_ltx_checkpoint("2.3", assets_root)


# --------------------------------------------------------------------------- shared by several test files


@pytest.fixture(scope="module")
def checkpoints(tiny_ltx_20, tiny_ltx_23):
    """The tiny LTX checkpoints keyed by version (test_text_pool*)."""
    return {"2.0": tiny_ltx_20, "2.3": tiny_ltx_23}


@pytest.fixture(scope="session")
def gemma(tiny_gemma_dir, tiny_gemma_comfy_file):
    """The tiny Gemma's snapshot dir, its ComfyUI single file and the snapshot-loaded tower
    (test_gemma*)."""
    from ltx_mgpu.text.encoder.loading import load_gemma_text_tower

    return {"snapshot": tiny_gemma_dir, "comfy": tiny_gemma_comfy_file, "tower": load_gemma_text_tower(tiny_gemma_dir)}


@pytest.fixture(scope="module")
def artifact(tiny_gemma_dir, tmp_path_factory):
    """The tiny Gemma quantized on the CPU into a fresh NF4 artifact, one per module (test_nf4*)."""
    from ltx_mgpu.text.nf4.quantize import quantize_nf4

    return quantize_nf4(tiny_gemma_dir, tmp_path_factory.mktemp("nf4") / "tiny-nf4", device="cpu")


@pytest.fixture(scope="module")
def nf4_tower(artifact):
    """The module's NF4 artifact loaded on the CPU (tests may wrap its layers, and undo it)."""
    from ltx_mgpu.text.nf4.load import load_nf4

    return load_nf4(artifact)


@pytest.fixture(scope="module")
def bf16_tower(tiny_gemma_dir):
    """The tiny Gemma loaded in bf16 from its snapshot."""
    from ltx_mgpu.text.encoder.loading import load_gemma_text_tower

    return load_gemma_text_tower(tiny_gemma_dir)


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_gemma_dir, tiny_gemma_comfy_file, tiny_ltx_23):
    """ComfyUI-like model folders ($LTX_MGPU_MODELS_DIR), a private pool runtime dir and cache
    (test_nodes*)."""
    from nodes_support import model_folders

    with model_folders(tmp_path_factory, tiny_gemma_dir, tiny_gemma_comfy_file, tiny_ltx_23) as models:
        yield models
