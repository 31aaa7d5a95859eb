"""Hostile things in the embedding cache directory (ltx_mgpu/text/cache/store.py, entry.py).

What sits at an entry's path (or at its shard directory) is not what the cache wrote: a FIFO,
a symbolic link (to ``/dev/zero``, to a valid entry elsewhere), a directory, an unreadable or
an oversized file, a shard directory that is a link out of the cache or another user's, a
flipped metadata bit; or the cache root itself is unreadable or became a file. Each must give
a miss with a warning (never a hang, an unbounded read or a traceback), the prompt is
re-encoded, nothing is written outside the cache root, and what the cache writes is private
(entries 0600, directories 0700).

Fast and hermetic: temp directories, random tensors, no pool. Lookups run in a thread with a
timeout (a hang fails the test instead of blocking it) under an address-space bound (an
unbounded read ends in ``MemoryError`` instead of exhausting the machine). Permission cases
cannot fail for root (root reads a mode-000 file); run as root, they run in a forked child
that drops to uid/gid 65534 (nobody) first, and are skipped only where that is impossible.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import resource
import select
import shutil
import signal
import stat
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

import pytest
import torch

from ltx_mgpu.text.cache.keys import CacheKeyParts
from ltx_mgpu.text.cache.store import (
    CacheDirectoryWarning,
    CacheEntryWarning,
    EmbeddingCache,
    encode_cached,
)
from ltx_mgpu.text.features import PromptEmbedding

D = 16
PARTS = CacheKeyParts(gemma_identity="a" * 64, projection_identity="b" * 64, weights_mode="bf16", token_budget=1024,
                      dtype="bfloat16")
PROMPT = "a hostile cat"
OTHER = "an unrelated dog"
LIMIT_S = 20.0  # seconds a lookup may take before it counts as a hang
NOBODY = 65534
IS_ROOT = os.geteuid() == 0


def embedding(prompt: str, dropped: int = 0) -> PromptEmbedding:
    """A deterministic stand-in for Gemma + projection: [T, D] float32 seeded by the prompt."""
    seed = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    return PromptEmbedding(torch.randn(1 + seed % 7, D, generator=gen), "2.3", dropped_tokens=dropped)


class Encoder:
    """Records the prompts it is asked to encode."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, prompts: list[str]) -> list[PromptEmbedding]:
        self.calls.append(list(prompts))
        return [embedding(p) for p in prompts]


@pytest.fixture
def cache(tmp_path) -> EmbeddingCache:
    """A cache made the cache's own way (root and one shard written by ``put``)."""
    c = EmbeddingCache(tmp_path / "cache")
    c.put(OTHER, PARTS, embedding(OTHER))
    return c


def entry_path(cache: EmbeddingCache, prompt: str = PROMPT) -> Path:
    """The entry path of ``prompt``, its shard directory made (as a plain ``mkdir`` makes it)."""
    path = cache.path_for(prompt, PARTS)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def bounded(fn, *args, unblock=None, **kwargs):
    """``fn(*args, **kwargs)`` in a thread, under a 2 GiB address-space headroom, within
    :data:`LIMIT_S`; returns ``(result, warnings)``. Fails the test on a hang (after calling
    ``unblock`` to release the thread) or on an exception (with its traceback)."""
    out: dict = {}

    def target():
        try:
            out["result"] = fn(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - reported below
            out["error"] = traceback.format_exc()

    with open("/proc/self/statm") as f:
        vsize = int(f.read().split()[0]) * resource.getpagesize()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    bound = vsize + 2 * 1024**3
    if hard != resource.RLIM_INFINITY:
        bound = min(bound, hard)
    thread = threading.Thread(target=target, daemon=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resource.setrlimit(resource.RLIMIT_AS, (bound, hard))
        try:
            thread.start()
            thread.join(LIMIT_S)
        finally:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        hung = thread.is_alive()
        if hung and unblock is not None:
            unblock()
            thread.join(LIMIT_S)
    assert not hung, f"{getattr(fn, '__name__', fn)} did not return within {LIMIT_S} s (it hangs)"
    assert "error" not in out, f"{getattr(fn, '__name__', fn)} raised:\n{out['error']}"
    return out["result"], list(caught)


def messages(caught, category) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, category)]


def tree(top: Path, skip: Path | None = None) -> dict[str, tuple]:
    """Everything under ``top`` (links not followed, ``skip`` left out): path -> (type, size, mtime)."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if skip is not None and (p == skip or skip in p.parents):
                continue
            st = os.lstat(p)
            found[str(p.relative_to(top))] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
    return found


def assert_private(cache: EmbeddingCache) -> None:
    """Every directory of the cache is 0700 and every entry 0600 (links are not followed)."""
    for dirpath, dirnames, filenames in os.walk(cache.root):
        for name in [None, *filenames]:
            p = Path(dirpath) if name is None else Path(dirpath) / name
            st = os.lstat(p)
            want = 0o700 if stat.S_ISDIR(st.st_mode) else 0o600
            assert stat.S_IMODE(st.st_mode) == want, f"{p} has mode {stat.S_IMODE(st.st_mode):o}, want {want:o}"
        del dirnames  # os.walk does not follow the links among them


def reencodes(cache: EmbeddingCache, outside: dict | None = None, top: Path | None = None) -> Encoder:
    """``PROMPT`` is re-encoded through ``encode_cached`` (no traceback, no hang), then a hit,
    bit-identical, from a private entry; nothing changed outside the cache root."""
    encoder = Encoder()
    (out, report), _ = bounded(encode_cached, cache, [PROMPT], PARTS, encoder, batch_size=1)
    assert encoder.calls == [[PROMPT]] and report.encoded == 1
    assert torch.equal(out[0].tensor, embedding(PROMPT).tensor)
    hit, caught = bounded(cache.get, PROMPT, PARTS)
    assert hit is not None and torch.equal(hit.tensor, embedding(PROMPT).tensor) and not caught
    assert_private(cache)
    if outside is not None:
        assert tree(top, skip=cache.root) == outside, "something was written outside the cache root"
    return encoder


# --------------------------------------------------------------------------- what is at an entry's path


def test_fifo_at_an_entry_path_is_a_miss_not_a_hang(cache, tmp_path):
    path = entry_path(cache)
    os.mkfifo(path)
    outside = tree(tmp_path, skip=cache.root)

    def unblock():  # a writer end lets a reader blocked in open() on the FIFO go on (to EOF)
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    got, caught = bounded(cache.get, PROMPT, PARTS, unblock=unblock)
    assert got is None and any(path.name in m for m in messages(caught, CacheEntryWarning))
    assert not path.exists()  # the FIFO was removed (never opened)
    reencodes(cache, outside, tmp_path)


@pytest.mark.parametrize("target", ["/dev/zero", "valid entry outside"])
def test_symlink_at_an_entry_path_is_refused(cache, tmp_path, target):
    """A link to /dev/zero is not read (an unbounded read); a link to a valid entry for this
    very key, outside the cache, is not served (an entry is only what the cache wrote)."""
    if target != "/dev/zero":
        planted = PromptEmbedding(torch.full((3, D), 7.0), "2.3")
        target = str(EmbeddingCache(tmp_path / "outside").put(PROMPT, PARTS, planted))
    path = entry_path(cache)
    os.symlink(target, path)
    outside = tree(tmp_path, skip=cache.root)
    got, caught = bounded(cache.get, PROMPT, PARTS)
    assert got is None and any(path.name in m for m in messages(caught, CacheEntryWarning))
    assert not os.path.lexists(path)  # the link was removed, its target left alone
    reencodes(cache, outside, tmp_path)


@pytest.mark.parametrize("filled", [False, True], ids=["empty", "not empty"])
def test_directory_at_an_entry_path_is_a_miss(cache, tmp_path, filled):
    """An empty directory is removed and the entry written; a non-empty one cannot be replaced:
    the prompt is still encoded, the write is warned about and skipped, and lookups stay misses."""
    path = entry_path(cache)
    path.mkdir()
    if filled:
        (path / "something").write_bytes(b"x")
    outside = tree(tmp_path, skip=cache.root)
    got, caught = bounded(cache.get, PROMPT, PARTS)
    assert got is None and any(path.name in m for m in messages(caught, CacheEntryWarning))
    if not filled:
        assert not path.exists()
        reencodes(cache, outside, tmp_path)
        return
    encoder = Encoder()
    (out, _), caught = bounded(encode_cached, cache, [PROMPT], PARTS, encoder, batch_size=1)
    assert encoder.calls == [[PROMPT]] and torch.equal(out[0].tensor, embedding(PROMPT).tensor)
    assert any("could not write" in str(w.message) for w in caught)
    assert bounded(cache.get, PROMPT, PARTS)[0] is None and path.is_dir()
    assert tree(tmp_path, skip=cache.root) == outside


def test_oversized_entry_is_not_read(cache, tmp_path):
    """A (sparse) 1 TiB file at an entry path is refused by its size, before any read."""
    path = entry_path(cache)
    with open(path, "wb") as f:
        f.truncate(1 << 40)
    outside = tree(tmp_path, skip=cache.root)
    got, caught = bounded(cache.get, PROMPT, PARTS)
    assert got is None and any(path.name in m and "limit" in m for m in messages(caught, CacheEntryWarning))
    assert not path.exists()
    reencodes(cache, outside, tmp_path)


def test_entry_over_the_per_entry_limit_is_not_written(tmp_path):
    cache = EmbeddingCache(tmp_path / "cache", max_entry_bytes=4096)
    with pytest.raises(OSError, match="limit") as info:
        cache.put(PROMPT, PARTS, PromptEmbedding(torch.randn(64, D), "2.3"))
    assert info.value.errno == errno.EFBIG
    with pytest.warns(UserWarning, match="could not write"):
        out, _ = encode_cached(cache, [PROMPT], PARTS, lambda ps: [PromptEmbedding(torch.randn(64, D), "2.3")], 1)
    assert out[0].tensor.shape == (64, D)
    assert not list(cache.root.rglob("*.safetensors"))


# --------------------------------------------------------------------------- permissions (as an unprivileged user)


def unprivileged(fn):
    """``fn(base)`` with ``base`` a fresh directory of this user, as a user who cannot bypass
    permissions: in-process for a normal user; as root, in a forked child that drops to uid/gid
    :data:`NOBODY` first (``fn`` returns something JSON-able; an exception fails the test)."""
    if not IS_ROOT:
        base = Path(tempfile.mkdtemp(prefix="ltx-hostile-"))
        try:
            return bounded(fn, base)[0]
        finally:
            _make_removable(base)
            shutil.rmtree(base, ignore_errors=True)
    base = Path(tempfile.mkdtemp(prefix="ltx-hostile-"))
    os.chown(base, NOBODY, NOBODY)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            result = {"result": bounded(fn, base)[0]}
        except BaseException:  # noqa: BLE001 - sent to the parent
            result = {"error": traceback.format_exc()}
            code = 1
        try:
            os.write(write, json.dumps(result).encode())
        finally:
            os._exit(code)
    os.close(write)
    try:
        chunks = []
        while True:
            ready, _, _ = select.select([read], [], [], LIMIT_S * 3)
            if not ready:
                os.kill(pid, signal.SIGKILL)
                pytest.fail(f"the unprivileged child did not finish within {LIMIT_S * 3} s")
            chunk = os.read(read, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        os.waitpid(pid, 0)
    finally:
        os.close(read)
        shutil.rmtree(base, ignore_errors=True)
    result = json.loads(b"".join(chunks) or b"{}")
    assert "error" not in result, result.get("error")
    return result["result"]


def _make_removable(base: Path) -> None:
    for dirpath, _, _ in os.walk(base):
        os.chmod(dirpath, 0o700)
    if base.exists():
        os.chmod(base, 0o700)


def _unreadable_entry(base: Path) -> dict:
    cache = EmbeddingCache(base / "cache")
    cache.put(OTHER, PARTS, embedding(OTHER))
    path = cache.put(PROMPT, PARTS, embedding(PROMPT))
    os.chmod(path, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = cache.get(PROMPT, PARTS)
        encoder = Encoder()
        out, _ = encode_cached(cache, [PROMPT], PARTS, encoder, batch_size=1)
        hit = cache.get(PROMPT, PARTS)
    return {"miss": got is None, "warned": [path.name in m for m in messages(caught, CacheEntryWarning)],
            "encoded": encoder.calls, "same": torch.equal(out[0].tensor, embedding(PROMPT).tensor),
            "hit": hit is not None and torch.equal(hit.tensor, embedding(PROMPT).tensor),
            "mode": stat.S_IMODE(os.lstat(path).st_mode)}


def test_unreadable_entry_is_a_miss_and_is_rewritten():
    r = unprivileged(_unreadable_entry)
    assert r["miss"] and any(r["warned"]) and r["encoded"] == [[PROMPT]] and r["same"] and r["hit"]
    assert r["mode"] == 0o600


def _unreadable_root(base: Path) -> dict:
    cache = EmbeddingCache(base / "cache")
    cache.put(PROMPT, PARTS, embedding(PROMPT))
    os.chmod(cache.root, 0)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = cache.get(PROMPT, PARTS)
            encoder = Encoder()
            out, report = encode_cached(cache, [PROMPT, OTHER, "third"], PARTS, encoder, batch_size=2)
    finally:
        os.chmod(cache.root, 0o700)
    return {"miss": got is None, "messages": [str(w.message) for w in caught],
            "root_warnings": messages(caught, CacheDirectoryWarning), "root": str(cache.root),
            "encoded": sum(encoder.calls, []), "same": torch.equal(out[0].tensor, embedding(PROMPT).tensor)}


def test_unreadable_cache_root_gives_one_warning_naming_the_setting():
    r = unprivileged(_unreadable_root)
    assert r["miss"] and r["same"] and r["encoded"] == [PROMPT, OTHER, "third"]
    assert len(r["messages"]) == len(r["root_warnings"]) == 1, r["messages"]
    assert r["root"] in r["root_warnings"][0] and "$LTX_MGPU_CACHE_DIR" in r["root_warnings"][0]


def _read_only_root(base: Path) -> dict:
    cache = EmbeddingCache(base / "cache")
    cache.put(OTHER, PARTS, embedding(OTHER))
    taken = cache.path_for(OTHER, PARTS).parent.name
    fresh = [p for p in (f"prompt {i}" for i in range(40)) if cache.path_for(p, PARTS).parent.name != taken][:3]
    os.chmod(cache.root, 0o500)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            encoder = Encoder()
            out, report = encode_cached(cache, [OTHER, *fresh], PARTS, encoder, batch_size=1)
    finally:
        os.chmod(cache.root, 0o700)
    return {"messages": [str(w.message) for w in caught], "root": str(cache.root), "hits": report.hits,
            "encoded": sum(encoder.calls, []) == fresh, "same": torch.equal(out[0].tensor, embedding(OTHER).tensor)}


def test_read_only_cache_root_serves_hits_and_warns_once_about_writes():
    r = unprivileged(_read_only_root)
    assert r["hits"] == 1 and r["same"] and r["encoded"]
    assert len(r["messages"]) == 1 and r["root"] in r["messages"][0] and "$LTX_MGPU_CACHE_DIR" in r["messages"][0]


def test_cache_root_that_became_a_file_gives_one_warning_naming_the_setting(cache):
    """(A root that is a file when the cache is made is refused then, naming the setting:
    tests/integration/test_generate.py.) One that becomes a file later is one warning, no traceback."""
    shutil.rmtree(cache.root)
    cache.root.write_bytes(b"not a directory")
    got, caught = bounded(cache.get, PROMPT, PARTS)
    assert got is None
    encoder = Encoder()
    (out, report), more = bounded(encode_cached, cache, [PROMPT, OTHER], PARTS, encoder, batch_size=1)
    assert sum(encoder.calls, []) == [PROMPT, OTHER] and torch.equal(out[0].tensor, embedding(PROMPT).tensor)
    caught += more
    assert len(caught) == len(messages(caught, CacheDirectoryWarning)) == 1, [str(w.message) for w in caught]
    assert str(cache.root) in str(caught[0].message) and "$LTX_MGPU_CACHE_DIR" in str(caught[0].message)
    assert caught[0].filename == __file__  # reported at the caller's line
    assert cache.root.read_bytes() == b"not a directory"


# --------------------------------------------------------------------------- shard directories


def test_symlinked_shard_directory_is_neither_read_nor_written(cache, tmp_path):
    """A shard directory that is a link out of the cache (to a place holding a valid entry for
    this very key): the entry there is not served, nothing is written there; the prompt is
    encoded (not cached: the link is not ours to replace) and eviction/clear leave it alone."""
    planted = PromptEmbedding(torch.full((3, D), 7.0), "2.3")
    elsewhere = EmbeddingCache(tmp_path / "outside").put(PROMPT, PARTS, planted).parent
    shard = cache.path_for(PROMPT, PARTS).parent
    assert not shard.exists()
    os.symlink(elsewhere, shard)
    outside = tree(tmp_path, skip=cache.root)
    got, caught = bounded(cache.get, PROMPT, PARTS)
    assert got is None and any(shard.name in m for m in messages(caught, CacheEntryWarning))
    encoder = Encoder()
    (out, _), caught = bounded(encode_cached, cache, [PROMPT], PARTS, encoder, batch_size=1)
    assert encoder.calls == [[PROMPT]] and torch.equal(out[0].tensor, embedding(PROMPT).tensor)
    assert any(shard.name in str(w.message) for w in caught)
    assert bounded(cache.put, OTHER + " 2", PARTS, embedding(OTHER))[0].parent != shard
    bounded(cache.clear)
    assert tree(tmp_path, skip=cache.root) == outside, "something was written (or removed) outside the cache root"
    assert os.path.islink(shard)


@pytest.mark.skipif(not IS_ROOT, reason="making a directory owned by another user needs root")
def test_shard_directory_of_another_user_is_not_used(cache, tmp_path):
    path = cache.put(PROMPT, PARTS, embedding(PROMPT))
    os.chown(path.parent, NOBODY, NOBODY)
    got, caught = bounded(cache.get, PROMPT, PARTS)
    assert got is None and any(path.parent.name in m and "uid" in m for m in messages(caught, CacheEntryWarning))
    with pytest.raises(OSError, match="uid"):
        cache.put(PROMPT, PARTS, embedding(PROMPT))
    assert os.lstat(path.parent).st_uid == NOBODY


# --------------------------------------------------------------------------- metadata covered by the checksum


def _flip_metadata(path: Path, field: str) -> str:
    """Flip one bit of the last character of metadata ``field``'s value, keeping the header
    valid JSON of the same length; returns the new value."""
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    marker = f'"{field}":"'.encode()
    start = data.index(marker, 8, 8 + n) + len(marker)
    end = start
    while data[end] != ord('"') or data[end - 1] == ord("\\"):
        end += 1
    for bit in range(7):
        c = data[end - 1] ^ (1 << bit)
        if 0x20 <= c < 0x7F and chr(c) not in '"\\':
            data[end - 1] = c
            break
    path.write_bytes(bytes(data))
    return json.loads(data[8 : 8 + n])["__metadata__"][field]


def test_bit_flip_in_dropped_tokens_is_a_miss(cache, tmp_path):
    path = cache.put(PROMPT, PARTS, embedding(PROMPT, dropped=5))
    assert _flip_metadata(path, "dropped_tokens") == "4"
    outside = tree(tmp_path, skip=cache.root)
    got, caught = bounded(cache.get, PROMPT, PARTS)
    assert got is None, f"a flipped dropped_tokens was served: {got.dropped_tokens}"
    assert any(path.name in m for m in messages(caught, CacheEntryWarning))
    reencodes(cache, outside, tmp_path)


@pytest.mark.parametrize("field", ["format", "key", "key_parts", "version", "dropped_tokens", "dtype", "crc32"])
def test_every_metadata_field_is_covered(cache, field):
    path = cache.put(PROMPT, PARTS, embedding(PROMPT, dropped=5))
    _flip_metadata(path, field)
    got, caught = bounded(cache.get, PROMPT, PARTS)
    assert got is None and any(path.name in m for m in messages(caught, CacheEntryWarning))


def test_extra_metadata_field_is_a_miss(cache):
    """A field the cache does not write is foreign, even if everything else checks out."""
    from safetensors.torch import load, save

    path = cache.put(PROMPT, PARTS, embedding(PROMPT))
    data = path.read_bytes()
    meta = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])["__metadata__"]
    path.write_bytes(save(load(data), metadata={**meta, "note": "planted"}))
    got, caught = bounded(cache.get, PROMPT, PARTS)
    assert got is None and any(path.name in m for m in messages(caught, CacheEntryWarning))


# --------------------------------------------------------------------------- privacy


def test_new_entries_and_directories_are_private(tmp_path):
    cache = EmbeddingCache(tmp_path / "new" / "cache")
    path = cache.put(PROMPT, PARTS, embedding(PROMPT))
    assert_private(cache)
    assert stat.S_IMODE(os.stat(cache.root).st_mode) == 0o700 == stat.S_IMODE(os.stat(path.parent).st_mode)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_existing_loose_entries_and_shards_of_ours_are_tightened(cache):
    """A cache written by an older version (shards 0755, entries 0644): a hit makes its entry
    and shard private, and a write makes its shard private."""
    path = cache.put(PROMPT, PARTS, embedding(PROMPT))
    os.chmod(path.parent, 0o755)
    os.chmod(path, 0o644)
    assert bounded(cache.get, PROMPT, PARTS)[0] is not None
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600 and stat.S_IMODE(os.lstat(path.parent).st_mode) == 0o700
    other = cache.path_for(OTHER, PARTS)
    os.chmod(other.parent, 0o755)
    cache.put(OTHER, PARTS, embedding(OTHER))
    assert_private(cache)


def test_the_digest_memo_is_private_like_the_cache(tmp_path, monkeypatch):
    """Issue 29, finding 14: ``digests.json`` (which model files this user has, and where) was
    0644; it is 0600 like the cache's entries, also when an older one was world-readable."""
    from ltx_mgpu import identity

    monkeypatch.setenv("LTX_MGPU_HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    memo = tmp_path / "home" / "digests.json"
    memo.write_text("{}")
    os.chmod(memo, 0o644)
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"weights")
    assert identity.file_digest(weights) == hashlib.sha256(b"weights").hexdigest()
    assert stat.S_IMODE(os.lstat(memo).st_mode) == 0o600
    assert [p.name for p in memo.parent.iterdir()] == ["digests.json"]  # no temporary file left
