"""Tests of the content-addressed prompt-embedding cache (ltx_mgpu/text/cache/store.py).

Hermetic: temp directories and random tensors stand in for Gemma's output.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import threading
import types
import warnings
import zlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save

from ltx_mgpu.text.cache.keys import FORMAT_VERSION, CacheKeyParts, cache_key, default_cache_dir
from ltx_mgpu.text.cache.store import CacheEntryWarning, CacheReport, EmbeddingCache, encode_cached
from ltx_mgpu.text.features import PromptEmbedding

D = 16
PARTS = CacheKeyParts(gemma_identity="a" * 64, projection_identity="b" * 64, weights_mode="nf4", token_budget=1024,
                      dtype="bfloat16")


def fake_embedding(prompt: str, version: str = "2.0") -> PromptEmbedding:
    """A deterministic stand-in for Gemma + projection: [T, D] float32 seeded by the prompt."""
    seed = int.from_bytes(hashlib.sha256(prompt.encode("utf-8", "surrogatepass")).digest()[:8], "little")
    gen = torch.Generator().manual_seed(seed)
    tokens = 1 + seed % 7
    return PromptEmbedding(torch.randn(tokens, D, generator=gen), version, dropped_tokens=seed % 3)


class RecordingEncoder:
    """Batch encoder returning *views into one padded batch tensor* (as a real batch does)."""

    def __init__(self, fail_on_call: int | None = None) -> None:
        self.calls: list[list[str]] = []
        self.fail_on_call = fail_on_call

    def __call__(self, prompts: list[str]) -> list[PromptEmbedding]:
        self.calls.append(list(prompts))
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise KeyboardInterrupt("interrupted mid-batch")
        singles = [fake_embedding(p) for p in prompts]
        batch = torch.zeros(len(prompts), 8, D)
        for i, e in enumerate(singles):
            batch[i, : e.num_tokens] = e.tensor
        return [dataclasses.replace(e, tensor=batch[i, : e.num_tokens]) for i, e in enumerate(singles)]


def never_encode(prompts: list[str]) -> list[PromptEmbedding]:
    raise AssertionError(f"encode_fn must not be called; got {prompts}")


@pytest.fixture
def cache(tmp_path) -> EmbeddingCache:
    return EmbeddingCache(tmp_path / "cache")


def test_hit_is_bit_identical(cache):
    emb = PromptEmbedding(torch.randn(11, D), "2.3", dropped_tokens=5)
    assert cache.get("a cat", PARTS) is None
    path = cache.put("a cat", PARTS, emb)
    assert path == cache.path_for("a cat", PARTS) and path.parent.name == path.stem[:2]
    got = cache.get("a cat", PARTS)
    assert torch.equal(got.tensor, emb.tensor) and got.tensor.dtype == torch.float32
    assert got.tensor.device.type == "cpu"
    assert (got.version, got.dropped_tokens) == ("2.3", 5)
    assert (cache.stats.hits, cache.stats.misses, cache.stats.writes) == (1, 1, 1)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp file left behind
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == str(FORMAT_VERSION) and meta["key"] == path.stem
    assert meta["key_parts"] == PARTS.to_json()


@pytest.mark.parametrize(
    "prompt, parts",
    [
        ("a cat ", PARTS),
        (" a cat", PARTS),
        ("a cat\n", PARTS),
        ("a  cat", PARTS),
        ("A cat", PARTS),
        ("a cat", dataclasses.replace(PARTS, gemma_identity="c" * 64)),
        ("a cat", dataclasses.replace(PARTS, projection_identity="c" * 64)),
        ("a cat", dataclasses.replace(PARTS, weights_mode="bf16")),
        ("a cat", dataclasses.replace(PARTS, token_budget=512)),
        ("a cat", dataclasses.replace(PARTS, dtype="float16")),
    ],
)
def test_any_key_component_change_misses(cache, prompt, parts):
    cache.put("a cat", PARTS, fake_embedding("a cat"))
    assert cache_key(prompt, parts) != cache_key("a cat", PARTS)
    assert cache.get(prompt, parts) is None
    assert cache.get("a cat", PARTS) is not None


def test_key_is_canonical():
    key = cache_key("a cat", PARTS)
    assert len(key) == 64 and int(key, 16) >= 0
    assert cache_key("a cat", CacheKeyParts(**dataclasses.asdict(PARTS))) == key
    assert cache_key("a cat", dataclasses.replace(PARTS, dtype=torch.bfloat16)) == key  # torch.dtype -> its name
    # field boundaries cannot be shifted between components
    p1 = dataclasses.replace(PARTS, gemma_identity="ab", projection_identity="c")
    p2 = dataclasses.replace(PARTS, gemma_identity="a", projection_identity="bc")
    assert cache_key("x", p1) != cache_key("x", p2)
    assert cache_key("\ud800 odd", PARTS) != cache_key("\ud801 odd", PARTS)  # lone surrogates hash too


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 7])


def _flip_tensor_byte(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40  # the tensor bytes are the file's tail
    path.write_bytes(bytes(data))


def _garbage(path):
    path.write_bytes(os.urandom(300))


def _other_entry(path):  # a valid file, but another prompt's entry
    other = EmbeddingCache(path.parents[2] / "elsewhere").put("a dog", PARTS, fake_embedding("a dog"))
    path.write_bytes(other.read_bytes())


@pytest.mark.parametrize("damage", [_truncate, _flip_tensor_byte, _garbage, _other_entry])
def test_damaged_entry_is_warned_removed_and_reencoded(cache, damage):
    path = cache.put("a cat", PARTS, fake_embedding("a cat"))
    damage(path)
    with pytest.warns(CacheEntryWarning, match=path.name):
        assert cache.get("a cat", PARTS) is None
    assert not path.exists() and cache.stats.damaged == 1

    path = cache.put("a cat", PARTS, fake_embedding("a cat"))
    damage(path)
    encoder = RecordingEncoder()
    with pytest.warns(CacheEntryWarning, match=path.name):
        out, report = encode_cached(cache, ["a cat", "a dog"], PARTS, encoder, batch_size=4)
    assert encoder.calls == [["a cat", "a dog"]]
    assert torch.equal(out[0].tensor, fake_embedding("a cat").tensor)
    assert (report.hits, report.misses, report.encoded) == (0, 2, 2)
    assert torch.equal(cache.get("a cat", PARTS).tensor, fake_embedding("a cat").tensor)


def test_concurrent_writers_of_one_key_leave_a_valid_entry(cache):
    a = PromptEmbedding(torch.randn(40, D), "2.0", 0)
    b = PromptEmbedding(torch.randn(23, D), "2.3", 1)
    cache.put("shared", PARTS, a)
    errors: list[BaseException] = []
    seen: list[PromptEmbedding | None] = []

    def writer(emb):
        try:
            for _ in range(40):
                cache.put("shared", PARTS, emb)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    def reader():
        try:
            for _ in range(80):
                seen.append(cache.get("shared", PARTS))
        except BaseException as exc:  # noqa: BLE001 - a CacheEntryWarning (made an error) lands here
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(e,)) for e in (a, b, a, b)] + [threading.Thread(target=reader)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheEntryWarning)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    assert cache.stats.damaged == 0
    for got in seen:  # a reader only ever sees a complete entry from one writer or the other
        assert got is not None and (torch.equal(got.tensor, a.tensor) or torch.equal(got.tensor, b.tensor))
    final = cache.get("shared", PARTS)
    assert torch.equal(final.tensor, a.tensor) or torch.equal(final.tensor, b.tensor)
    assert [p.suffix for p in cache.root.rglob("*")] in ([".safetensors"], ["", ".safetensors"])


def test_views_into_one_batch_round_trip_as_their_own_rows(cache):
    batch = torch.randn(3, 9, D)
    transposed = torch.randn(9, 3, D)  # non-contiguous views too
    prompts = ["first", "second", "third"]
    for i, p in enumerate(prompts):
        cache.put(p, PARTS, PromptEmbedding(batch[i, 2:], "2.0"))
        cache.put(p + "/t", PARTS, PromptEmbedding(transposed[:, i], "2.0"))
    for i, p in enumerate(prompts):
        got = cache.get(p, PARTS).tensor
        assert got.shape == (7, D) and torch.equal(got, batch[i, 2:])
        assert torch.equal(cache.get(p + "/t", PARTS).tensor, transposed[:, i])
        with safe_open(cache.path_for(p, PARTS), framework="pt") as f:
            assert f.get_slice("embedding").get_shape() == [7, D]
    rows = [cache.get(p, PARTS).tensor for p in prompts]
    assert not torch.equal(rows[0], rows[1]) and not torch.equal(rows[1], rows[2])


def test_fully_cached_batch_never_calls_encode_fn(cache):
    prompts = ["a", "b", "c"]
    for p in prompts:
        cache.put(p, PARTS, fake_embedding(p))
    out, report = encode_cached(cache, prompts + ["a"], PARTS, never_encode, batch_size=2)
    assert [torch.equal(o.tensor, fake_embedding(p).tensor) for o, p in zip(out, prompts + ["a"])] == [True] * 4
    assert (report.hits, report.misses, report.encoded) == (3, 0, 0)
    assert str(report).startswith("3 prompts: 3 cached, 0 encoded in ")


def test_partial_cache_encodes_only_misses_once_in_order(cache):
    cache.put("b", PARTS, fake_embedding("b"))
    encoder = RecordingEncoder()
    prompts = ["a", "b", "c", "a", "d", "e", "c"]
    out, report = encode_cached(cache, prompts, PARTS, encoder, batch_size=2)
    assert encoder.calls == [["a", "c"], ["d", "e"]]
    for o, p in zip(out, prompts):
        assert torch.equal(o.tensor, fake_embedding(p).tensor) and o.dropped_tokens == fake_embedding(p).dropped_tokens
    assert report == dataclasses.replace(report, hits=1, misses=4, encoded=4)
    assert isinstance(report, CacheReport)
    for p in "acde":  # each result was written (as its own rows, not the padded batch)
        assert torch.equal(cache.get(p, PARTS).tensor, fake_embedding(p).tensor)


def test_whole_prompts_share_the_entries_of_prompts_that_fit_the_smaller_budget(cache):
    """``short``: an encoder that cuts nothing up to 8192 tokens (``parts``) and the same encoder at
    a budget of 4 tokens (``short``): a prompt that fits 4 tokens lives under ``short``, shared;
    an entry there that dropped tokens is not the whole prompt; a longer one lives under ``parts``."""
    whole = dataclasses.replace(PARTS, token_budget=8192)
    short = dataclasses.replace(PARTS, token_budget=4)
    fits, cut = PromptEmbedding(torch.randn(3, D), "2.3"), PromptEmbedding(torch.randn(4, D), "2.3", dropped_tokens=2)
    cache.put("fits", short, fits)
    cache.put("long", short, cut)  # what the budgeted encoder made of it
    full = {"long": PromptEmbedding(torch.randn(6, D), "2.3"), "new": PromptEmbedding(torch.randn(2, D), "2.3"),
            "new long": PromptEmbedding(torch.randn(9, D), "2.3")}
    calls = []

    def encode(prompts):
        calls.append(list(prompts))
        return [full[p] for p in prompts]

    out, report = encode_cached(cache, ["fits", "long", "new", "new long"], whole, encode, batch_size=8, short=short)
    assert calls == [["long", "new", "new long"]] and (report.hits, report.encoded) == (1, 3)
    assert torch.equal(out[0].tensor, fits.tensor) and torch.equal(out[1].tensor, full["long"].tensor)
    assert cache.get("fits", whole) is None and cache.get("new", whole) is None  # stored once, under short
    assert torch.equal(cache.get("new", short).tensor, full["new"].tensor)
    assert torch.equal(cache.get("long", whole).tensor, full["long"].tensor)
    assert cache.get("long", short).dropped_tokens == 2  # the budgeted entry stays for the budgeted encoder
    assert torch.equal(cache.get("new long", whole).tensor, full["new long"].tensor)
    again, report = encode_cached(cache, ["fits", "long", "new", "new long"], whole, never_encode, batch_size=8,
                                  short=short)
    assert report.hits == 4 and all(torch.equal(a.tensor, b.tensor) for a, b in zip(again, out))


def test_interrupted_batch_resumes(cache):
    prompts = [f"prompt {i}" for i in range(5)]
    with pytest.raises(KeyboardInterrupt):
        encode_cached(cache, prompts, PARTS, RecordingEncoder(fail_on_call=2), batch_size=2)
    assert [cache.get(p, PARTS) is not None for p in prompts] == [True, True, False, False, False]
    encoder = RecordingEncoder()
    out, report = encode_cached(cache, prompts, PARTS, encoder, batch_size=2)
    assert encoder.calls == [prompts[2:4], prompts[4:]]
    assert (report.hits, report.encoded) == (2, 3)
    assert all(torch.equal(o.tensor, fake_embedding(p).tensor) for o, p in zip(out, prompts))


def test_lru_eviction_bounds_size_and_evicts_least_recently_used(tmp_path):
    probe = EmbeddingCache(tmp_path / "probe")
    entry = probe.put("x", PARTS, PromptEmbedding(torch.randn(8, D), "2.0")).stat().st_size
    cache = EmbeddingCache(tmp_path / "lru", max_bytes=3 * entry + entry // 2)
    emb = {p: PromptEmbedding(torch.randn(8, D), "2.0") for p in "abcde"}
    for p in "abc":
        cache.put(p, PARTS, emb[p])
    assert cache.size_bytes() == 3 * entry
    assert cache.get("a", PARTS) is not None  # a is now more recent than b and c
    cache.put("d", PARTS, emb["d"])
    assert [cache.path_for(p, PARTS).exists() for p in "abcd"] == [True, False, True, True]
    cache.put("e", PARTS, emb["e"])
    assert [cache.path_for(p, PARTS).exists() for p in "abcde"] == [True, False, False, True, True]
    assert cache.size_bytes() <= cache.max_bytes and cache.stats.evictions == 2
    # an entry larger than the whole bound is kept: the one just written is never evicted
    tiny = EmbeddingCache(tmp_path / "tiny", max_bytes=entry // 2)
    tiny.put("a", PARTS, emb["a"])
    tiny.put("b", PARTS, emb["b"])
    assert tiny.get("a", PARTS) is None and torch.equal(tiny.get("b", PARTS).tensor, emb["b"].tensor)
    cache.clear()
    assert cache.size_bytes() == 0 and cache.get("a", PARTS) is None


def test_get_moves_to_the_requested_device(cache):
    emb = fake_embedding("moving")
    cache.put("moving", PARTS, emb)
    got = cache.get("moving", PARTS, device="meta")
    assert got.tensor.device.type == "meta" and got.tensor.shape == emb.tensor.shape
    many = cache.get_many(["moving", "absent"], PARTS, device=torch.device("meta"))
    assert many[0].tensor.device.type == "meta" and many[1] is None
    out, _ = encode_cached(cache, ["moving", "new"], PARTS, RecordingEncoder(), batch_size=1, device="meta")
    assert [o.tensor.device.type for o in out] == ["meta", "meta"]
    assert cache.get("new", PARTS).tensor.device.type == "cpu"  # entries are stored on CPU


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    monkeypatch.delenv("LTX_MGPU_CACHE_DIR", raising=False)
    monkeypatch.setenv("LTX_MGPU_HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / "embeddings"
    assert "folder_paths" not in sys.modules  # never imported
    comfy = types.ModuleType("folder_paths")
    comfy.get_user_directory = lambda: str(tmp_path / "ComfyUI" / "user")
    monkeypatch.setitem(sys.modules, "folder_paths", comfy)
    assert default_cache_dir() == tmp_path / "ComfyUI" / "user" / "ltx_mgpu" / "embeddings"
    monkeypatch.setenv("LTX_MGPU_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == tmp_path / "explicit"
    assert EmbeddingCache().root == tmp_path / "explicit"


def test_bad_input_errors(cache):
    with pytest.raises(ValueError, match="weights_mode"):
        dataclasses.replace(PARTS, weights_mode="fp8")
    with pytest.raises(ValueError, match="token_budget"):
        dataclasses.replace(PARTS, token_budget=0)
    with pytest.raises(ValueError, match="gemma_identity"):
        dataclasses.replace(PARTS, gemma_identity="")
    with pytest.raises(TypeError, match="PromptEmbedding"):
        cache.put("x", PARTS, torch.zeros(2, D))
    with pytest.raises(ValueError, match="meta"):
        cache.put("x", PARTS, PromptEmbedding(torch.zeros(2, D, device="meta"), "2.0"))
    with pytest.raises(ValueError, match="max_bytes"):
        EmbeddingCache(cache.root, max_bytes=0)
    with pytest.raises(ValueError, match="batch_size"):
        encode_cached(cache, ["x"], PARTS, RecordingEncoder(), batch_size=0)
    with pytest.raises(ValueError, match="returned 1 embeddings for 2 prompts"):
        encode_cached(cache, ["x", "y"], PARTS, lambda ps: [fake_embedding(ps[0])], batch_size=2)


def test_bf16_exact_embeddings_are_stored_in_half_the_bytes(tmp_path):
    """An embedding computed in bf16 (float32 values that are all bf16 values) is stored as bf16
    and comes back as the same float32 bits; any other float32 tensor is stored as it is."""
    cache = EmbeddingCache(tmp_path)
    exact = torch.randn(40, 64).to(torch.bfloat16).float()
    inexact = exact.clone()
    inexact[3, 5] += 1e-4  # not a bf16 value any more
    for prompt, tensor, stored in (("exact", exact, torch.bfloat16), ("inexact", inexact, torch.float32)):
        path = cache.put(prompt, PARTS, PromptEmbedding(tensor, "2.0"))
        with safe_open(str(path), "pt") as f:
            assert f.get_tensor("embedding").dtype == stored
            assert f.metadata()["dtype"] == "float32"
        got = cache.get(prompt, PARTS).tensor
        assert got.dtype == torch.float32 and torch.equal(got, tensor)
    sizes = {p.stem: p.stat().st_size for p in tmp_path.rglob("*.safetensors")}
    assert min(sizes.values()) < 0.6 * max(sizes.values())


# --------------------------------------------------------------------------- non-finite embeddings (issue 29)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_embedding_is_never_cached_nor_returned(cache, value):
    def lying(prompts):  # an encoder whose weights are damaged: the second prompt's embedding is NaN
        out = [fake_embedding(p) for p in prompts]
        out[1].tensor[0, 0] = value
        return out

    with pytest.raises(ValueError, match=r"the embedding of prompt 'b dog' holds NaN or infinite values; nothing of "
                                         r"it is cached or returned"):
        encode_cached(cache, ["a cat", "b dog"], PARTS, lying, batch_size=8)
    assert cache.size_bytes() == 0 and cache.stats.writes == 0
    bad = fake_embedding("b dog")
    bad.tensor[0, 0] = value
    with pytest.raises(ValueError, match=r"prompt 'b dog': the embedding holds NaN or infinite values; it is not "
                                         r"cached"):
        cache.put("b dog", PARTS, bad)
    assert cache.get("b dog", PARTS) is None


def _entry_with_nan(key: str) -> bytes:
    """An entry as format 4 wrote it before embeddings were checked: NaN values under a valid
    checksum (CRC-32 of the canonical JSON metadata, then of ``|dtype|shape|`` and the bytes, as
    ``ltx_mgpu.text.cache.entry`` documents it)."""
    t = torch.ones(3, D)
    t[0, 0] = float("nan")
    meta = {"format": str(FORMAT_VERSION), "key": key, "key_parts": PARTS.to_json(), "version": "2.0",
            "dropped_tokens": "0", "dtype": "float32"}
    crc = zlib.crc32(json.dumps(meta, sort_keys=True, separators=(",", ":")).encode())
    crc = zlib.crc32(f"|{t.dtype}|{tuple(t.shape)}|".encode(), crc)
    meta["crc32"] = f"{zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc):08x}"
    return save({"embedding": t}, metadata=meta)


def test_a_non_finite_entry_of_an_older_version_is_discarded_and_encoded_again(cache):
    good = cache.put("b dog", PARTS, fake_embedding("b dog"))  # makes the directories, ours
    path = cache.path_for("a cat", PARTS)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.write_bytes(_entry_with_nan(path.stem))
    path.chmod(0o600)
    with pytest.warns(CacheEntryWarning, match="NaN or infinite"):
        assert cache.get("a cat", PARTS) is None
    assert not path.exists() and good.exists()
    out, report = encode_cached(cache, ["a cat"], PARTS, RecordingEncoder(), batch_size=8)
    assert report.encoded == 1 and bool(torch.isfinite(out[0].tensor).all())


def test_the_finite_checks_of_a_miss_and_a_hit_make_nothing_of_the_embeddings_size(cache):
    """The checks that keep a non-finite embedding from being cached or returned are one
    reduction each (``ltx_mgpu.finite``): ``torch.isfinite(t).all()`` wrote a bool tensor of the
    embedding's size, twice per miss and once per hit, on the host of every encode through the
    cache (several times the reduction's cost; the encoder's own check is one reduction since
    b78713e)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.masks: list[int] = []  # the sizes of the bool tensors made

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                    self.masks.append(t.numel())
            return out

    def encode(prompts):
        return [PromptEmbedding(torch.randn(64, D), "2.0") for _ in prompts]

    with Ops() as ops:
        encode_cached(cache, ["a cat"], PARTS, encode, batch_size=8)  # a miss, written
        out, report = encode_cached(cache, ["a cat"], PARTS, never_encode, batch_size=8)  # a hit, read
    assert report.hits == 1 and out[0].tensor.shape == (64, D)
    assert [n for n in ops.masks if n > 1] == []
