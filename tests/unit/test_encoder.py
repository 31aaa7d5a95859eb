"""Prompt encoding end to end on the tiny Gemma + tiny LTX-2 projections: parity with an
independent per-prompt computation, batching, truncation, the cache path and the CLI."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from ltx_mgpu.text.cache.keys import cache_key_parts
from ltx_mgpu.text.cache.store import EmbeddingCache, encode_cached
from ltx_mgpu.text.config import TextEncoderConfig
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.encoder.local import LocalTextEncoder
from ltx_mgpu.text.encoder.prompt import NonFiniteEmbeddingError, PromptEncoder
from ltx_mgpu.text.features import load_projection
from ltx_mgpu.text.gemma.tokenizer import PromptTooLongError

REPO = Path(__file__).resolve().parents[2]

PROMPTS = [
    "a red fox running through snow at dawn",
    "a lighthouse in a storm",
    "the quick brown fox jumps over the lazy dog while the camera pans slowly to the left",
    "water",
    "a city at night with neon lights reflected in puddles and people walking",
    "two cats",
    "a slow dolly shot of a kitchen",
    "an astronaut floating above the earth, the sun rising behind",
    "rain",
]


@pytest.fixture(scope="module")
def tower(tiny_gemma_dir):
    return load_gemma_text_tower(tiny_gemma_dir, dtype=torch.float32)


@pytest.fixture(scope="module", params=["2.0", "2.3"])
def encoder(request, tower, tiny_ltx_20, tiny_ltx_23):
    ckpt = tiny_ltx_20 if request.param == "2.0" else tiny_ltx_23
    proj = load_projection(ckpt, num_layers=tower.num_hidden_states)
    return PromptEncoder(tower, proj)


def _reference(encoder: PromptEncoder, prompt: str) -> torch.Tensor:
    """Straightforward float64 computation for one prompt: no padding at all, then the
    version's normalisation over all its tokens and the checkpoint's projection."""
    tok = encoder.tower.tokenizer
    ids = torch.tensor([tok(prompt)["input_ids"]])
    with torch.inference_mode():
        hs = encoder.tower.model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    x = torch.stack(hs, dim=-1)[0].double()  # [T, D, L]
    proj = encoder.projection
    d, n_layers = proj.embedding_dim, proj.num_layers

    def checkpoint_weight(lin):  # undo our layer-major storage: back to feature d*L + l
        return lin.weight.double().reshape(-1, n_layers, d).transpose(1, 2).reshape(lin.weight.shape[0], -1)

    if proj.version == "2.0":
        mean = x.mean(dim=(0, 1), keepdim=True)
        rng = x.amax(dim=(0, 1), keepdim=True) - x.amin(dim=(0, 1), keepdim=True)
        feats = (8 * (x - mean) / (rng + 1e-6)).reshape(x.shape[0], -1)
        return feats @ checkpoint_weight(proj.aggregate_embed).T
    normed = (x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + 1e-6)).reshape(x.shape[0], -1)
    outs = []
    for lin in (proj.video_aggregate_embed, proj.audio_aggregate_embed):
        outs.append((normed * math.sqrt(lin.out_features / d)) @ checkpoint_weight(lin).T + lin.bias.double())
    return torch.cat(outs, dim=-1)


def test_encoder_matches_independent_computation_with_left_padding(encoder):
    out = encoder.encode(PROMPTS[:4], batch_size=4)  # different lengths -> left padding
    for prompt, emb in zip(PROMPTS, out):
        ref = _reference(encoder, prompt)
        assert emb.tensor.shape == ref.shape
        assert emb.tensor.dtype == torch.float32 and emb.tensor.device.type == "cpu"
        torch.testing.assert_close(emb.tensor.double(), ref, rtol=1e-4, atol=1e-4)
    assert out[0].tensor.shape[1] == encoder.projection.out_features


@pytest.mark.parametrize("batch_size", [1, 3, 8])
def test_batched_equals_one_by_one(encoder, batch_size):
    singles = [encoder.encode([p], batch_size=1)[0].tensor for p in PROMPTS]
    batched = encoder.encode(PROMPTS, batch_size=batch_size)
    assert len(batched) == len(PROMPTS)
    for s, b in zip(singles, batched):
        torch.testing.assert_close(b.tensor, s, rtol=1e-5, atol=1e-5)


def test_rows_written_into_given_tensors_equal_the_returned_ones(encoder):
    """encode(out=...): token_counts gives the shapes in advance; out(i) is asked for prompt i's
    row once it is ready, the row lands there (one flat buffer here, as the pool's shared
    memory) and equals a plain encode; out(i) giving None means a new tensor; a wrong shape is
    refused, naming the row."""
    counts = encoder.token_counts(PROMPTS)
    width = encoder.projection.out_features
    flat = torch.full((sum(counts) * width,), float("nan"))
    rows = [t.view(n, width) for t, n in zip(flat.split([n * width for n in counts]), counts)]
    asked = []
    got = encoder.encode(PROMPTS, batch_size=3, out=lambda i: asked.append(i) or rows[i])
    plain = encoder.encode(PROMPTS, batch_size=3)
    assert asked == list(range(len(PROMPTS)))
    for g, r, p in zip(got, rows, plain):
        assert g.tensor.data_ptr() == r.data_ptr() and torch.equal(g.tensor, p.tensor)
    assert not flat.isnan().any()
    some = encoder.encode(PROMPTS[:2], out=lambda i: None if i else torch.empty(counts[0], width))
    assert all(torch.equal(s.tensor, p.tensor) for s, p in zip(some, encoder.encode(PROMPTS[:2])))
    with pytest.raises(ValueError, match="row 1 needs a CPU"):
        encoder.encode(PROMPTS[:2], out=lambda i: torch.empty(counts[i] + i, width))


def test_prompt_over_budget_is_truncated_with_a_warning(tower, tiny_ltx_23):
    proj = load_projection(tiny_ltx_23, num_layers=tower.num_hidden_states)
    enc = PromptEncoder(tower, proj, token_budget=16)
    long = " ".join(["word"] * 40)
    with pytest.warns(UserWarning, match=r"tokens were dropped") as rec:
        out = enc.encode([long, "short prompt"], batch_size=2)
    n_tokens = len(tower.tokenizer(long)["input_ids"])
    assert str(n_tokens - 16) in str(rec[0].message)
    assert out[0].num_tokens == 16 and out[0].dropped_tokens == n_tokens - 16
    assert out[1].dropped_tokens == 0
    # the kept part is the prompt's first 16 tokens: identical to encoding them alone
    ids = tower.tokenizer(long)["input_ids"][:16]
    alone = enc.encode_tokens(torch.tensor([ids]), torch.ones(1, 16, dtype=torch.long))[0]
    torch.testing.assert_close(out[0].tensor, alone.tensor, rtol=1e-5, atol=1e-5)
    strict = PromptEncoder(tower, proj, token_budget=16, truncate=False)
    with pytest.raises(PromptTooLongError, match="16"):
        strict.encode([long])


def test_max_tokens_encodes_a_prompt_whole_whatever_the_budget(tower, tiny_ltx_23):
    """``max_tokens`` (the CLIP's whole prompts): no cut at the budget, as an encoder with room for
    the prompt; over ``max_tokens`` an error even when the encoder truncates; token_counts' tokens
    are reused only by an encode with the same limits."""
    proj = load_projection(tiny_ltx_23, num_layers=tower.num_hidden_states)
    enc = PromptEncoder(tower, proj, token_budget=16)
    roomy = PromptEncoder(tower, proj, token_budget=256)
    long = " ".join(["word"] * 40)
    n_tokens = len(tower.tokenizer(long)["input_ids"])
    whole = enc.encode([long, "short prompt"], batch_size=2, max_tokens=256)
    want = roomy.encode([long, "short prompt"], batch_size=2)
    assert [e.num_tokens for e in whole] == [n_tokens, want[1].num_tokens] and whole[0].dropped_tokens == 0
    assert all(torch.equal(w.tensor, r.tensor) for w, r in zip(whole, want))
    with pytest.raises(PromptTooLongError, match=f"{n_tokens} tokens .*budget of 20"):
        enc.encode([long], max_tokens=20)
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        enc.encode([long], max_tokens=0)
    assert enc.token_counts([long], max_tokens=256) == [n_tokens]
    with pytest.warns(UserWarning, match="tokens were dropped"):  # other limits: tokenized again, cut
        assert enc.encode([long])[0].num_tokens == 16


def test_projection_gemma_mismatch_is_a_clear_error(tower, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "proj.safetensors"
    save_file({"text_embedding_projection.aggregate_embed.weight": torch.zeros(8, 3840 * 49)}, str(path))
    proj = load_projection(path)
    with pytest.raises(ValueError, match="Pair the checkpoint with its Gemma"):
        PromptEncoder(tower, proj)


def test_cache_round_trip_keeps_rows_apart_and_never_loads_gemma_when_cached(tiny_gemma_dir, tiny_ltx_23, tmp_path):
    cache = EmbeddingCache(tmp_path / "cache")
    spec = LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="float32"))
    first, report = spec.encode(PROMPTS[:3], batch_size=3, cache=cache)
    assert report.misses == 3 and spec.loaded
    fresh = LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="float32"))
    second, report2 = fresh.encode(PROMPTS[:3], batch_size=3, cache=cache)
    assert report2.hits == 3 and report2.encoded == 0
    assert not fresh.loaded, "a fully cached prompt set must not construct Gemma"
    for a, b in zip(first, second):
        assert torch.equal(a.tensor, b.tensor)
    assert not torch.equal(second[0].tensor[:5], second[1].tensor[:5])
    singles = [spec.build().encode([p])[0].tensor for p in PROMPTS[:3]]
    for s, b in zip(singles, second):
        torch.testing.assert_close(b.tensor, s, rtol=1e-5, atol=1e-5)
    # a different weights mode or dtype is another key: no hit
    other = LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="bfloat16"))
    assert cache_key_parts(other.config) != cache_key_parts(fresh.config)
    assert cache.get(PROMPTS[0], cache_key_parts(other.config)) is None


def test_the_local_encoder_checks_its_prompts_once_where_they_come_in(tiny_gemma_dir, tiny_ltx_23, tmp_path,
                                                                      monkeypatch):
    """``LocalTextEncoder.encode`` is where a prompt enters: it is checked there, before the cache
    or Gemma is touched, and nothing below (the cache, the prompt encoder, the tokenizer) checks
    it again."""
    from ltx_mgpu.text.encoder import local as local_encoder
    from ltx_mgpu.text.gemma import tokenizer

    spec = LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="float32"))
    cache = EmbeddingCache(tmp_path / "cache")
    for bad, match in ((["a cat", b"bytes"], r"prompts\[1\] is bytes, expected str"),
                       (["caf\udcff"], r"prompts\[0\] is not valid Unicode text: a lone surrogate '\\udcff'")):
        with pytest.raises(ValueError, match=match):
            spec.encode(bad, cache=cache)
        assert not spec.loaded and not any(cache.root.rglob("*.safetensors"))
    calls = {"entry": 0, "below": 0}
    real = tokenizer.check_prompts

    def counting(where):
        def check(*a, **k):
            calls[where] += 1
            return real(*a, **k)
        return check

    monkeypatch.setattr(local_encoder, "check_prompts", counting("entry"))
    monkeypatch.setattr(tokenizer, "check_prompts", counting("below"))
    spec.encode(PROMPTS[:2], batch_size=1, cache=cache)
    assert calls == {"entry": 1, "below": 0}  # once at the entry; the encoder and the tokenizer trust it


def test_encodes_from_two_threads_equal_the_sequential_ones(encoder):
    """One encoder used by two threads at once (an encode collects hidden states with hooks on the
    shared layers): each gets its own prompts' embeddings, as run one after the other."""
    import threading

    sets = [PROMPTS[:3], PROMPTS[3:]]
    want = [encoder.encode(p, batch_size=3) for p in sets]
    got: dict[int, list] = {}
    start = threading.Barrier(2)

    def run(k):
        start.wait()
        for _ in range(3):
            got[k] = encoder.encode(sets[k], batch_size=3)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(2):
        assert [e.tensor.shape for e in got[k]] == [e.tensor.shape for e in want[k]]
        assert all(torch.equal(g.tensor, w.tensor) for g, w in zip(got[k], want[k]))


def test_an_encode_after_token_counts_reuses_its_tokens_and_gives_the_same_rows(encoder, monkeypatch):
    """token_counts keeps its tokenization for the encode that follows (the pool's): sub-batches
    take their rows from it, trimmed to their own longest prompt, and the embeddings equal those
    of an encode that tokenizes each sub-batch itself, bit for bit."""
    import ltx_mgpu.text.encoder.prompt as tokenizer  # where PromptEncoder looks tokenize up

    prompts = PROMPTS[:5]
    encoder._pretokenized = None
    plain = encoder.encode(prompts, batch_size=2)
    calls = []
    real = tokenizer.tokenize
    monkeypatch.setattr(tokenizer, "tokenize", lambda *a, **k: calls.append(len(a[1])) or real(*a, **k))
    assert encoder.token_counts(prompts) == [e.num_tokens for e in plain] and calls == [5]
    reused = encoder.encode(prompts, batch_size=2)
    assert calls == [5]  # no sub-batch tokenized again
    assert all(torch.equal(r.tensor, p.tensor) for r, p in zip(reused, plain))
    encoder.encode(["a prompt it has not seen"])
    assert calls == [5, 1]


# --------------------------------------------------------------------------- the cache key, memoised


def _age(*paths: Path, seconds: float = 60.0) -> None:
    """Move mtimes into the past (files written by a test are too fresh to memoise)."""
    import time

    for p in paths:  # a directory with everything in it
        for f in ([p, *p.rglob("*")] if p.is_dir() else [p]):
            os.utime(f, (time.time() - seconds, time.time() - seconds))


def test_cache_key_parts_are_memoised_until_a_source_file_changes(tiny_gemma_dir, tiny_ltx_23, tmp_path, monkeypatch):
    """Asked for on every request, the parts are computed once and re-checked by stats alone;
    rewriting a file, adding one beside the weights or touching the projection recomputes them
    (and a change of content changes them); files modified within RACY_SECONDS are not memoised."""
    import shutil

    import ltx_mgpu.text.cache.keys as sources  # where cache_key_parts looks source_identity up

    gemma, proj = tmp_path / "gemma", tmp_path / "proj.safetensors"
    shutil.copytree(tiny_gemma_dir, gemma)
    shutil.copy(tiny_ltx_23, proj)
    calls = []  # one per computation of the parts
    real = sources.source_identity
    monkeypatch.setattr(sources, "source_identity", lambda *a: calls.append(a) or real(*a))
    spec = LocalTextEncoder(TextEncoderConfig(gemma, proj, dtype="float32"))

    first = cache_key_parts(spec.config)
    assert cache_key_parts(spec.config) == first and len(calls) == 2  # fresh files: computed each time
    _age(gemma, proj, tmp_path)
    first = cache_key_parts(spec.config)
    assert [cache_key_parts(spec.config) for _ in range(3)] == [first] * 3 and len(calls) == 3  # memoised
    assert cache_key_parts(TextEncoderConfig(gemma, proj, dtype="float32")) == first and len(calls) == 3

    (gemma / "notes.txt").write_text("a file beside the weights")  # the directory changed: recomputed, same key
    _age(gemma)
    assert cache_key_parts(spec.config) == first and len(calls) == 4
    config = gemma / "config.json"
    config.write_text(config.read_text() + " ")
    _age(gemma)
    changed = cache_key_parts(spec.config)
    assert changed.gemma_identity != first.gemma_identity and len(calls) == 5
    proj.write_bytes(proj.read_bytes())  # same bytes, new mtime: re-checked, same identity
    _age(proj, tmp_path)
    assert cache_key_parts(spec.config) == changed and len(calls) == 6
    assert cache_key_parts(TextEncoderConfig(gemma, proj, dtype="bfloat16")).dtype == "bfloat16"  # its own entry


def test_a_tokenizer_copied_into_a_comfy_files_stem_directory_recomputes_the_parts(tiny_gemma_dir,
                                                                                  tiny_gemma_comfy_file,
                                                                                  tiny_ltx_23, tmp_path):
    """A ComfyUI file without an embedded tokenizer takes ``<dir>/<stem>/``'s before ``<dir>/``'s;
    a tokenizer copied into an existing, empty ``<dir>/<stem>/`` changes the source (found by
    review: the memo watched only the listed files' directories)."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    from ltx_mgpu.text.gemma.sources import gemma_identity

    d = tmp_path / "te"
    d.mkdir()
    with safe_open(str(tiny_gemma_comfy_file), "pt") as f:
        save_file({k: f.get_tensor(k)
                   for k in f.keys() if k != "spiece_model"},  # noqa: SIM118 - safe_open is not iterable
                  str(d / "gemma.safetensors"), metadata=dict(f.metadata()))
    shutil.copy(tiny_gemma_dir / "tokenizer.json", d)
    (d / "gemma").mkdir()
    proj = tmp_path / "proj.safetensors"
    shutil.copy(tiny_ltx_23, proj)
    _age(tmp_path)
    spec = LocalTextEncoder(TextEncoderConfig(d / "gemma.safetensors", proj, dtype="float32"))
    before = cache_key_parts(spec.config)
    shutil.copy(tiny_gemma_dir / "tokenizer.model", d / "gemma")  # only d/gemma's mtime changes
    assert (cache_key_parts(spec.config).gemma_identity == gemma_identity(d / "gemma.safetensors")
            != before.gemma_identity)


def test_a_file_added_in_an_empty_subdirectory_of_an_nf4_artifact_recomputes_the_parts(tiny_ltx_23, tmp_path):
    import shutil

    from ltx_mgpu.text.gemma.sources import NF4_MANIFEST, gemma_identity

    art = tmp_path / "art"
    (art / "notes" / "deeper").mkdir(parents=True)
    (art / NF4_MANIFEST).write_text("{}")  # detection reads the manifest's presence only
    (art / "nf4-00001.safetensors").write_bytes(b"x" * 64)
    proj = tmp_path / "proj.safetensors"
    shutil.copy(tiny_ltx_23, proj)
    _age(tmp_path)
    spec = LocalTextEncoder(TextEncoderConfig(art, proj, dtype="float32"))
    before = cache_key_parts(spec.config)
    (art / "notes" / "deeper" / "readme.txt").write_text("added")  # only deeper's mtime changes
    assert cache_key_parts(spec.config).gemma_identity == gemma_identity(art) != before.gemma_identity


def test_a_snapshot_swapped_while_its_parts_are_computed_is_not_memoised(tiny_gemma_dir, tiny_ltx_23, tmp_path,
                                                                        monkeypatch):
    """``mv gemma gemma.old && mv gemma.new gemma`` while the first call hashes the weights
    (minutes for 12B): the value describes the old version, so it must not be kept under the
    new directory's stats (found by review: the signature was taken after computing)."""
    import shutil

    import ltx_mgpu.text.cache.keys as sources  # where cache_key_parts looks source_identity up
    from ltx_mgpu.text.gemma.sources import gemma_identity

    models = tmp_path / "models"
    models.mkdir()
    gemma, new = models / "gemma", models / "gemma.new"
    shutil.copytree(tiny_gemma_dir, gemma)
    shutil.copytree(tiny_gemma_dir, new)
    (new / "config.json").write_text((new / "config.json").read_text() + " ")  # another version
    proj = tmp_path / "proj.safetensors"
    shutil.copy(tiny_ltx_23, proj)
    _age(tmp_path)
    real = sources.source_identity

    def swapping(source, files):
        value = real(source, files)
        os.rename(gemma, models / "gemma.old")
        os.rename(new, gemma)
        return value

    monkeypatch.setattr(sources, "source_identity", swapping)
    spec = LocalTextEncoder(TextEncoderConfig(gemma, proj, dtype="float32"))
    old = cache_key_parts(spec.config)
    monkeypatch.setattr(sources, "source_identity", real)
    assert cache_key_parts(spec.config).gemma_identity == gemma_identity(gemma) != old.gemma_identity


def test_a_non_finite_embedding_is_refused_naming_the_prompt_and_the_layer(tiny_gemma_dir, tiny_ltx_23, tmp_path):
    """A damaged tower (one NaN weight, as a lying file that got past its load would give): the
    encode fails naming the prompt and the first hidden state that is not finite; nothing is
    returned, and through the cache nothing is cached either."""
    tower = load_gemma_text_tower(tiny_gemma_dir, dtype=torch.float32)
    encoder = PromptEncoder(tower, load_projection(tiny_ltx_23, num_layers=tower.num_hidden_states))
    prompts = ["a cat", "two cats", "rain"]
    rain = tower.tokenizer("rain", add_special_tokens=False)["input_ids"][-1]
    embeddings = tower.model.get_input_embeddings().weight
    with torch.no_grad():
        saved = embeddings[rain].clone()
        embeddings[rain] = float("nan")  # only the third prompt has this token
    with pytest.raises(NonFiniteEmbeddingError, match=r"prompt 2 \('rain'\): its embedding holds NaN or infinite "
                                                      r"values, from Gemma's hidden state 0 \(the token embeddings"):
        encoder.encode(prompts, batch_size=2)
    with torch.no_grad():
        embeddings[rain] = saved
        tower.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    match = (r"prompt 0 \('a cat'\): its embedding holds NaN or infinite values, from Gemma's hidden state 2 \(the "
             r"output of decoder layer 1, float32\) on: the weights of .* are damaged there")
    with pytest.raises(NonFiniteEmbeddingError, match=match):
        encoder.encode(prompts, batch_size=2)
    cache = EmbeddingCache(tmp_path / "cache")
    parts = cache_key_parts(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="float32"))
    with pytest.raises(NonFiniteEmbeddingError, match=r"prompt 0 \('rain'\)"):
        encode_cached(cache, ["rain"], parts, encoder.encode, batch_size=8)
    assert cache.size_bytes() == 0


def test_the_finite_check_of_the_rows_is_one_reduction_each(tower, tiny_ltx_23):
    """The check that keeps a non-finite embedding from being returned reads each row once
    (``torch.aminmax``) and makes nothing of a row's size: ``torch.isfinite(row).all()`` on the
    host (fa442e1) wrote and read a row-sized bool tensor per prompt, in the wall time of every
    encode (``benchmarks/host.py`` times both checks; ``benchmarks/results/notes.md``, issue 30)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: list[str] = []
            self.masks: list[tuple[int, ...]] = []  # the shapes of the bool tensors made

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append(str(func.overloadpacket))
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                    self.masks.append(tuple(t.shape))
            return out

    encoder = PromptEncoder(tower, load_projection(tiny_ltx_23, num_layers=tower.num_hidden_states))
    prompts = PROMPTS[:3]
    with Ops() as ops:
        rows = encoder.encode(prompts, batch_size=3)
    # torch.isfinite is decomposed before dispatch (abs, ne, eq, mul: no aten.isfinite), so look at
    # what it makes: bool tensors of a row's shape (Gemma's own attention masks are [B, 1, T, T])
    shapes = {tuple(r.tensor.shape) for r in rows}
    big = [shape for shape in ops.masks if shape in shapes]
    assert big == [], big
    assert ops.calls.count("aten.aminmax") == len(prompts)
    assert all(bool(torch.isfinite(r.tensor).all()) for r in rows)
