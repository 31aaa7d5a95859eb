"""Gemma across a 2-rank pool with real processes (CPU ranks on gloo): every placement gives the
in-process embeddings and leaves them on every rank; the cache is read before the pool is contacted;
``encode --pool`` attaches to a ``pool start --detach`` pool. The pool is shared by the tests of this file."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from pool_support import cleanup, pool_pids, short_dir, wait_all_gone
from text_pool_support import PROMPTS, check, encode, reference

from ltx_mgpu.client import launch
from ltx_mgpu.client.errors import PoolError
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.client.spec import resolve_spec
from ltx_mgpu.client.text import encode_prompts, pool_key
from ltx_mgpu.text.cache.store import EmbeddingCache
from ltx_mgpu.text.config import TextEncoderConfig
from ltx_mgpu.text.embedding_files import load_embeddings
from ltx_mgpu.text.encoder.local import LocalTextEncoder

REPO = launch.repo_root()


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "ltx_mgpu", *args], cwd=REPO, env=_env(), timeout=timeout,
                          capture_output=True, text=True)


@pytest.fixture(scope="module")
def pool2(base):
    """A detached 2-rank pool started by the CLI (as a user would), stopped by the CLI at the end."""
    common = ["--gpus", "cpu", "--nproc", "2", "--runtime-dir", str(base)]
    out = _cli("pool", "start", "--detach", *common)
    assert out.returncode == 0, out.stderr
    client = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, start=False)
    pids = pool_pids(client)
    yield client
    client.close()
    stop = _cli("pool", "stop", *common)
    assert stop.returncode == 0 and f"stopped pool pid {pids[0][0]}" in stop.stdout, stop.stderr
    assert wait_all_gone(pids) == []


# --------------------------------------------------------------------------- placements


@pytest.mark.parametrize("placement", ["single", "accelerate", "batch_parallel"])
def test_each_placement_gives_the_in_process_embeddings_on_every_rank(pool2, tiny_gemma_dir, checkpoints, placement):
    encoder = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], placement=placement, dtype="float32")
    seen = []
    result, tensors = encode(pool2, encoder, PROMPTS[:3], on_progress=lambda *p: seen.append(p))
    check(result, tensors, reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:3]), 2)
    assert result["placement"] == placement and result["wire_dtype"] == "float32"
    assert result["owners"] == ([0, 0, 1] if placement == "batch_parallel" else [0, 0, 0])
    rounds = 1 if placement == "batch_parallel" else 2  # 2 prompts per Gemma forward
    assert [s for s in seen if s[0] == "encode"] == [("encode", k, rounds) for k in range(1, rounds + 1)]
    status = pool2.status()
    te = status["ranks"][0]["models"]["text_encoder"]
    assert te["key"] == pool_key(encoder) and te["placement"] == placement and te["holds_model"]
    assert status["ranks"][0]["models"]["text_embeddings"]["count"] == 3
    if placement == "accelerate":  # one CPU device: every layer on it, behind Accelerate's hooks
        again = pool2.request("load_text_encoder", encoder.to_params(pool_key(encoder)), timeout=60)[0]
        assert again.pop("timeline").keys() == {"received", "started", "finished"}
        assert again == {
            "key": pool_key(encoder), "placement": "accelerate", "weights": "bf16", "version": "2.3", "width": 48,
            "holders": [0], "reused": True, "seconds": 0.0, "layers": {"cpu": list(range(6))}}


@pytest.mark.parametrize("placement", ["single", "accelerate", "batch_parallel"])
def test_nf4_works_with_every_placement(pool2, tiny_gemma_dir, checkpoints, placement):
    # bf16 compute: the same sub-batches as in-process ([0, 1], [2] for every placement here)
    encoder = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], weights="nf4", placement=placement)
    result, tensors = encode(pool2, encoder, PROMPTS[:3], batch_size=2)
    check(result, tensors, reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:3], "nf4", "bfloat16", 2), 2)
    assert pool2.status()["ranks"][0]["models"]["text_encoder"]["weights"] == "nf4"


# --------------------------------------------------------------------------- client-side cache


def test_fully_cached_request_makes_no_pool_call(tiny_gemma_dir, tiny_ltx_23, tmp_path):
    cache = EmbeddingCache(tmp_path / "cache")
    spec = LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="float32"))
    cached, _ = spec.encode(PROMPTS[:3], cache=cache)
    nowhere = short_dir()
    try:  # no pool runs there and this client may not start one: any request raises PoolError
        client = PoolClient(resolve_spec("cpu", 2, "with-owner", nowhere), start=False)
        encoder = dataclasses.replace(spec.config, placement="batch_parallel")
        got, report = encode_prompts(client, encoder, PROMPTS[:3] + PROMPTS[:1], cache=cache)
        assert (report.hits, report.misses, report.encoded) == (3, 0, 0)
        assert [torch.equal(g.tensor, c.tensor) for g, c in zip(got, cached + cached[:1])] == [True] * 4
        assert list(nowhere.iterdir()) == []  # nothing was started or even created
        with pytest.raises(PoolError, match="no pool runs"):  # one miss: the pool would be contacted
            encode_prompts(client, encoder, PROMPTS[:4], cache=cache)
    finally:
        cleanup(nowhere)


def test_only_the_misses_go_to_the_pool(pool2, tiny_gemma_dir, tiny_ltx_23, tmp_path):
    cache = EmbeddingCache(tmp_path / "cache")
    spec = LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, dtype="float32"))
    spec.encode(PROMPTS[:1], cache=cache)
    encoder = dataclasses.replace(spec.config, placement="single")
    got, report = encode_prompts(pool2, encoder, PROMPTS[:3], cache=cache, batch_size=2)
    assert (report.hits, report.encoded) == (1, 2)
    for g, ref in zip(got, reference(tiny_gemma_dir, tiny_ltx_23, PROMPTS[:3])):
        torch.testing.assert_close(g.tensor, ref.tensor, rtol=1e-5, atol=1e-5)
    assert cache.stats.writes == 3  # the pool's two are cached now
    again, report = encode_prompts(pool2, encoder, PROMPTS[:3], cache=cache)
    assert report.encoded == 0 and all(torch.equal(a.tensor, g.tensor) for a, g in zip(again, got))


def test_a_text_encoder_swapped_by_another_client_is_reloaded(pool2, base, tiny_gemma_dir, checkpoints):
    mine = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.0"], dtype="float32")
    theirs = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], dtype="float32")
    other = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, start=False)
    swaps = []

    def on_progress(phase, step, total):  # while our load finishes, another client queues its own
        if phase == "load_text_encoder" and step == total and not swaps:
            swaps.append(other.submit("load_text_encoder", theirs.to_params(pool_key(theirs))))
            assert next(swaps[0].events(timeout=30))["event"] == "accepted"  # queued before our encode

    try:
        got, report = encode_prompts(pool2, mine, PROMPTS[:2], on_progress=on_progress)
        assert swaps and swaps[0].wait(timeout=60)[0]["key"] == pool_key(theirs)  # it ran before our encode
    finally:
        other.close()
    assert report.encoded == 2
    for g, ref in zip(got, reference(tiny_gemma_dir, checkpoints["2.0"], PROMPTS[:2])):
        torch.testing.assert_close(g.tensor, ref.tensor, rtol=1e-5, atol=1e-5)
    assert pool2.status()["ranks"][0]["models"]["text_encoder"]["key"] == pool_key(mine)


# --------------------------------------------------------------------------- CLI


def test_cli_encode_pool_attaches_to_a_detached_pool(pool2, base, tiny_gemma_dir, tiny_ltx_20, tmp_path):
    out = tmp_path / "emb.safetensors"
    args = ["encode", "--pool", "--gpus", "cpu", "--nproc", "2", "--runtime-dir", str(base), "--placement",
            "batch_parallel", "--gemma", str(tiny_gemma_dir), "--projection", str(tiny_ltx_20), "--dtype", "float32",
            "--cache", str(tmp_path / "cache"), "--out", str(out), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1],
            "--prompt", PROMPTS[3]]
    first = _cli(*args)
    assert first.returncode == 0, first.stderr
    assert f"pool: pid {pool2.pid}, 2 rank(s), placement batch_parallel, attached" in first.stdout
    assert "3 prompts: 0 cached, 3 encoded" in first.stdout
    prompts, embeddings = load_embeddings(out)
    assert prompts == [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    for e, ref in zip(embeddings, reference(tiny_gemma_dir, tiny_ltx_20, prompts)):
        torch.testing.assert_close(e.tensor, ref.tensor, rtol=1e-5, atol=1e-5)
    second = _cli(*args)
    assert second.returncode == 0 and "pool: not contacted (every prompt cached)" in second.stdout
    assert "3 prompts: 3 cached, 0 encoded" in second.stdout
    assert launch.find_live_pool(base / "cpu-2").pid == pool2.pid  # attached, never a second pool


def test_one_rank_pool_holds_the_encoders_own_tensors(tmp_path, tiny_gemma_dir, checkpoints):
    """World size 1 moves nothing (no broadcast, no device copy) and still equals in-process."""
    out = tmp_path / "ws1.safetensors"
    common = ["--gemma", str(tiny_gemma_dir), "--projection", str(checkpoints["2.3"]), "--dtype", "float32",
              "--no-cache", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]
    rt = short_dir()  # AF_UNIX paths are short; pytest's tmp_path may not be
    try:
        run = _cli("encode", "--pool", "--gpus", "cpu", "--nproc", "1", "--runtime-dir", str(rt), "--out", str(out),
                   *common)
    finally:
        cleanup(rt)
    assert run.returncode == 0, run.stderr
    _, got = load_embeddings(out)
    ref = reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:2])
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.tensor, r.tensor, rtol=1e-5, atol=1e-5)


def test_stop_for_another_rank_count_names_what_runs_and_stops_nothing(pool2, base):
    """``pool stop --nproc 3`` while a 2-rank pool runs: it says no pool of that set runs and
    which one does (it said "no pool is running", which was false)."""
    out = _cli("pool", "stop", "--gpus", "cpu", "--nproc", "3", "--runtime-dir", str(base))
    assert out.returncode == 0, out.stderr
    assert f"no pool for --gpus cpu --nproc 3 is running under {base}; running: cpu-2" in out.stdout
    assert pool2.status()["pool"]["world_size"] == 2  # still serving
