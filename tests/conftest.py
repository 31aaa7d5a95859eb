"""Shared fixtures: the embedded tiny models, built once per test session in a temp dir."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


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
