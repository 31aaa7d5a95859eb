"""The compile cache without compiling: its private directory, damaged files ignored, the
setting, and the message a first call at a size gives (``ltx_mgpu.denoise.compiling``). The
round trip through two processes: ``tests/integration/test_compile_cache.py``."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from unittest import mock

import pytest
import torch

from ltx_mgpu.denoise import compiling
from ltx_mgpu.denoise.compiling import (
    ARTIFACT_MAGIC,
    CompileCache,
    CompileCacheWarning,
    CompileWatch,
    compile_message,
    compiled_message,
    graph_key,
    private_dir,
)


class Block(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return x + self.lin(x)


class Model(torch.nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList(Block(width) for _ in range(3))

    def forward(self, x):
        for b in self.transformer_blocks:
            x = b(x)
        return x


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LTX_MGPU_COMPILE_CACHE_DIR", str(tmp_path / "compile"))
    monkeypatch.delenv("LTX_MGPU_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "ind")))
    return tmp_path / "compile"


def test_the_directory_is_made_private_and_a_looser_one_of_ours_tightened(tmp_path):
    made = private_dir(tmp_path / "a" / "b")
    assert stat.S_IMODE(os.lstat(made).st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    private_dir(loose)
    assert stat.S_IMODE(os.lstat(loose).st_mode) == 0o700


def test_a_link_or_a_file_is_refused_as_the_directory(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(PermissionError, match=r"compile cache .*link is a symbolic link; remove it or set "
                                              r"\$LTX_MGPU_COMPILE_CACHE_DIR"):
        private_dir(tmp_path / "link")
    (tmp_path / "file").write_text("x")
    with pytest.raises((PermissionError, FileExistsError)):
        private_dir(tmp_path / "file")


def test_a_refused_directory_means_no_cache_with_a_warning(tmp_path, monkeypatch):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    monkeypatch.setenv("LTX_MGPU_COMPILE_CACHE_DIR", str(tmp_path / "link"))
    logs = []
    with pytest.warns(CompileCacheWarning, match="compile cache not used: compile cache .* is a symbolic link"):
        assert CompileCache.open("k" * 64, log=lambda t, lvl: logs.append((lvl, t))) is None
    assert logs and logs[0][0] == "warning"


def test_the_setting_turns_it_off(cache_env, monkeypatch):
    monkeypatch.setenv("LTX_MGPU_COMPILE_CACHE", "off")
    assert CompileCache.open("k" * 64) is None
    assert not cache_env.exists()


def test_open_points_inductor_at_the_private_directory(cache_env):
    cache = CompileCache.open("k" * 64, log=lambda t, lvl: None)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache_env / "inductor")
    for d in (cache_env, cache_env / "inductor", cache_env / "artifacts"):
        assert stat.S_IMODE(os.lstat(d).st_mode) == 0o700
    assert torch._inductor.config.fx_graph_cache and torch._functorch.config.enable_autograd_cache
    assert cache.path("abc").parent == cache_env / "artifacts"


@pytest.mark.parametrize("content", [
    b"garbage",  # not ours
    ARTIFACT_MAGIC + b"\0" * 32 + b"payload",  # digest mismatch (flipped bytes)
    ARTIFACT_MAGIC + hashlib.sha256(b"not torch's").digest() + b"not torch's",  # torch refuses the payload
], ids=["foreign", "damaged", "refused-by-torch"])
def test_a_damaged_artifact_file_is_ignored_removed_and_warned_about(cache_env, content):
    logs = []
    cache = CompileCache.open("k" * 64, log=lambda t, lvl: logs.append((lvl, t)))
    path = cache.path("0123456789abcdef")
    path.write_bytes(content)
    with pytest.warns(CompileCacheWarning, match=r"compile cache file .* ignored and removed .*that size compiles"):
        assert cache.load_all() == 0
    assert not path.exists()
    assert [lvl for lvl, _ in logs] == ["warning"]


def test_a_link_at_an_artifact_path_is_not_followed(cache_env, tmp_path):
    cache = CompileCache.open("k" * 64, log=lambda t, lvl: None)
    target = tmp_path / "elsewhere.bin"
    payload = b"x"
    target.write_bytes(ARTIFACT_MAGIC + hashlib.sha256(payload).digest() + payload)
    cache.path("0123456789abcdef").symlink_to(target)
    with pytest.warns(CompileCacheWarning):
        assert cache.load_all() == 0
    assert target.exists()  # the link is removed, never its target


def test_the_message_names_the_size_and_what_it_costs():
    assert compile_message(6144, cached=False) == (
        "compiling the transformer blocks for 6,144 video tokens, first time at this size: up to a minute")
    assert compile_message(6144, cached=True) == (
        "compiling the transformer blocks for 6,144 video tokens, from the compile cache: a few seconds")
    assert compile_message(1536, cached=False, world_size=4) == (
        "compiling the transformer blocks for 1,536 video tokens per GPU, first time at this size: up to a minute")
    assert compile_message(6144, cached=False, bucketed=True) == (
        "compiling the transformer blocks for up to 6,144 video tokens, first time at this size: up to a minute")
    assert compiled_message(6144, 38.7) == "compiled the transformer blocks for 6,144 video tokens in 39 s"
    assert compiled_message(1536, 2.2, world_size=4, bucketed=True) == (
        "compiled the transformer blocks for up to 1,536 video tokens per GPU in 2 s")


def test_a_first_call_at_each_size_is_announced_once_and_saved(cache_env, monkeypatch):
    model = Model()
    cache = CompileCache.open(graph_key(model, "cpu"), log=lambda t, lvl: None)
    saved = []
    monkeypatch.setattr(cache, "save", lambda size: saved.append(size))
    watch = CompileWatch(model, cache)
    said, done = [], []
    watch.on_compile = lambda text, cached: said.append((text, cached))
    watch.on_compiled = done.append
    with torch.no_grad():
        for t in (6144 // 64, 96, 100, 96):
            model(torch.randn(2, t, 8))
    assert said == [(compile_message(96, False), False), (compile_message(100, False), False)]
    assert [re.sub(r"in \d+ s$", "in N s", d) for d in done] == [
        "compiled the transformer blocks for 96 video tokens in N s",
        "compiled the transformer blocks for 100 video tokens in N s"]  # each compile's end, once
    assert len(saved) == 2 and saved[0] != saved[1]


def test_a_size_an_earlier_run_saved_is_announced_as_cached_and_not_saved_again(cache_env, monkeypatch):
    model = Model()
    cache = CompileCache.open(graph_key(model, "cpu"), log=lambda t, lvl: None)
    watch = CompileWatch(model, cache)
    said, saved = [], []
    watch.on_compile = lambda text, cached: said.append(cached)
    x = torch.randn(1, 40, 8)
    with torch.no_grad():
        model(x)  # learns the size key: the save of a plain (uncompiled) model has nothing to save
    size = next(iter(watch.seen))
    cache.path(size).write_bytes(b"from an earlier run")
    monkeypatch.setattr(cache, "save", lambda s: saved.append(s))
    fresh = CompileWatch(model, cache)
    fresh.on_compile = lambda text, cached: said.append(cached)
    with torch.no_grad():
        model(x)
    assert said[-1] is True and saved == []


def test_the_graph_key_changes_with_what_changes_the_graph():
    a, b = Model(8), Model(16)
    assert graph_key(a, "cpu") == graph_key(Model(8), "cpu")  # weights' values do not matter
    assert len({graph_key(a, "cpu"), graph_key(b, "cpu"), graph_key(a, "cpu", world_size=2),
                graph_key(a, "cpu", layout="cfg_ulysses"), graph_key(a.to(torch.bfloat16), "cpu")}) == 5
    with mock.patch.object(compiling, "GRAPHS_REVISION", compiling.GRAPHS_REVISION + 1):  # our graphs change
        assert graph_key(a, "cpu") != graph_key(Model(8), "cpu")
