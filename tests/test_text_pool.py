"""Gemma across the pool with real processes (CPU ranks on gloo): every placement gives the
in-process embeddings and leaves them on every rank; batch-parallel splits; bad input keeps the
pool serving; the cache is read before the pool is contacted; ``encode --pool`` attaches to a
``pool start --detach`` pool. Two pools (2 and 4 ranks) are shared by the tests of this file."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from ltx_mgpu import protocol
from ltx_mgpu.client import BadInputError, PoolClient, PoolError
from ltx_mgpu.pool import launch
from ltx_mgpu.pool.engines import BadInput
from ltx_mgpu.pool.text_jobs import parse_load_request
from ltx_mgpu.remote_text import PoolTextEncoder, embeddings_from_result, encode_prompts, upcast
from ltx_mgpu.text import placement as tp
from ltx_mgpu.text import sharding
from ltx_mgpu.text.cache import EmbeddingCache
from ltx_mgpu.text.encoder import TextEncoderSpec, load_embeddings
from ltx_mgpu.text.encoder import encode_prompts as encode_in_process
from pool_support import cleanup, pool_pids, raw_connect, raw_hello, read_answer, short_dir, wait_all_gone

pytestmark = pytest.mark.slow
REPO = launch.repo_root()

PROMPTS = [
    "a red fox running through snow at dawn",
    "a lighthouse in a storm",
    "the quick brown fox jumps over the lazy dog while the camera pans slowly to the left",
    "water",
    "a city at night with neon lights reflected in puddles",
    "two cats",
    "an astronaut floating above the earth, the sun rising behind",
]


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


@pytest.fixture(scope="module")
def pool4(base):
    client = PoolClient.connect(gpus="cpu", nproc=4, runtime_dir=base, startup_timeout=180)
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def checkpoints(tiny_ltx_20, tiny_ltx_23):
    return {"2.0": tiny_ltx_20, "2.3": tiny_ltx_23}


_REFERENCE: dict = {}


def _reference(gemma, ckpt, prompts, weights="bf16", dtype="float32", batch_size=None):
    """In-process embeddings (``TextEncoderSpec.build().encode``): one prompt at a time, or in
    sub-batches of ``batch_size`` (bf16 results depend on the batch's padding, fp32 ones agree)."""
    spec = _REFERENCE.get((gemma, ckpt, weights, dtype))
    if spec is None:
        spec = _REFERENCE[(gemma, ckpt, weights, dtype)] = TextEncoderSpec(gemma, ckpt, weights, dtype=dtype)
    if batch_size:
        return spec.build().encode(prompts, batch_size=batch_size)
    return [spec.build().encode([p])[0] for p in prompts]


def _encode(client, encoder, prompts, batch_size=2, verify=True, on_progress=None):
    """Load (if needed) and encode through the pool without the cache; returns (result, tensors)."""
    from ltx_mgpu.remote_text import ensure_text_encoder

    key = encoder.key()
    ensure_text_encoder(client, encoder, key, timeout=120)
    return client.request("encode", {"prompts": prompts, "batch_size": batch_size, "expect": key, "verify": verify},
                          on_progress=on_progress, timeout=120)


def _check(result, tensors, reference, world_size):
    assert result["count"] == len(reference)
    embeddings = embeddings_from_result(result, tensors)  # float32 upcasts of the wire dtype
    for i, (ref, emb) in enumerate(zip(reference, embeddings)):
        assert str(tensors[f"prompt_{i}"].dtype) == "torch." + result["wire_dtype"]
        got = emb.tensor
        assert got.dtype == torch.float32 and got.shape == ref.tensor.shape
        torch.testing.assert_close(got, ref.tensor, rtol=1e-5, atol=1e-5)
        assert result["dropped_tokens"][i] == ref.dropped_tokens and result["version"] == ref.version
    # every rank holds every prompt's embedding, bit for bit what rank 0 returned
    returned = [hashlib.sha256(e.tensor.contiguous().numpy().tobytes()).hexdigest() for e in embeddings]
    assert len(result["rank_digests"]) == world_size and result["consistent"]
    assert all(d == returned for d in result["rank_digests"])


# --------------------------------------------------------------------------- placements


@pytest.mark.parametrize("placement", ["single", "accelerate", "batch_parallel"])
def test_each_placement_gives_the_in_process_embeddings_on_every_rank(pool2, tiny_gemma_dir, checkpoints, placement):
    encoder = PoolTextEncoder(tiny_gemma_dir, checkpoints["2.3"], placement=placement, dtype="float32")
    seen = []
    result, tensors = _encode(pool2, encoder, PROMPTS[:3], on_progress=lambda *p: seen.append(p))
    _check(result, tensors, _reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:3]), 2)
    assert result["placement"] == placement and result["wire_dtype"] == "float32"
    assert result["owners"] == ([0, 0, 1] if placement == "batch_parallel" else [0, 0, 0])
    rounds = 1 if placement == "batch_parallel" else 2  # 2 prompts per Gemma forward
    assert [s for s in seen if s[0] == "encode"] == [("encode", k, rounds) for k in range(1, rounds + 1)]
    status = pool2.status()
    te = status["ranks"][0]["models"]["text_encoder"]
    assert te["key"] == encoder.key() and te["placement"] == placement and te["holds_model"]
    assert status["ranks"][0]["models"]["text_embeddings"]["count"] == 3
    if placement == "accelerate":  # one CPU device: every layer on it, behind Accelerate's hooks
        assert pool2.request("load_text_encoder", encoder.load_params(encoder.key()), timeout=60)[0] == {
            "key": encoder.key(), "placement": "accelerate", "weights": "bf16", "version": "2.3", "width": 48,
            "holders": [0], "reused": True, "seconds": 0.0, "layers": {"cpu": list(range(6))}}


@pytest.mark.parametrize("placement", ["single", "accelerate", "batch_parallel"])
def test_nf4_works_with_every_placement(pool2, tiny_gemma_dir, checkpoints, placement):
    # bf16 compute: the same sub-batches as in-process ([0, 1], [2] for every placement here)
    encoder = PoolTextEncoder(tiny_gemma_dir, checkpoints["2.3"], weights="nf4", placement=placement)
    result, tensors = _encode(pool2, encoder, PROMPTS[:3], batch_size=2)
    _check(result, tensors, _reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:3], "nf4", "bfloat16", 2), 2)
    assert pool2.status()["ranks"][0]["models"]["text_encoder"]["weights"] == "nf4"


def test_batch_parallel_with_more_ranks_than_prompts(pool4, tiny_gemma_dir, checkpoints):
    encoder = PoolTextEncoder(tiny_gemma_dir, checkpoints["2.3"], placement="batch_parallel", dtype="float32")
    result, tensors = _encode(pool4, encoder, PROMPTS[:2])
    assert result["owners"] == [0, 1]  # ranks 2 and 3 encode nothing but still receive both
    _check(result, tensors, _reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:2]), 4)


def test_batch_parallel_uneven_split_keeps_prompt_order(pool4, tiny_gemma_dir, checkpoints):
    encoder = PoolTextEncoder(tiny_gemma_dir, checkpoints["2.0"], placement="batch_parallel", dtype="float32")
    result, tensors = _encode(pool4, encoder, PROMPTS, batch_size=1)
    assert result["owners"] == [0, 0, 1, 1, 2, 2, 3]  # 7 over 4: the remainder to the first ranks
    _check(result, tensors, _reference(tiny_gemma_dir, checkpoints["2.0"], PROMPTS), 4)
    assert result["broadcast_bytes"] == sum(t.numel() * 4 for t in tensors.values())


# --------------------------------------------------------------------------- bad input


def test_bad_input_is_rejected_on_every_rank_and_the_pool_keeps_serving(pool4, tiny_gemma_dir, checkpoints, tmp_path):
    pid = pool4.pid
    good = PoolTextEncoder(tiny_gemma_dir, checkpoints["2.3"], placement="batch_parallel", dtype="float32")
    params = good.load_params("k")
    wrong = tmp_path / "wrong_projection.safetensors"  # LTX-2.0 layout for a Gemma with 4 hidden states
    save_file({"text_embedding_projection.aggregate_embed.weight": torch.zeros(32, 4 * 64)}, str(wrong))
    cases = [
        ({"source": str(tmp_path / "no-gemma")}, "Gemma 3 source not found"),
        ({"projection": str(tmp_path / "none.safetensors")}, "projection source not found"),
        ({"projection": str(wrong)}, "Pair the checkpoint with its Gemma"),
        ({"source": "relative/gemma"}, "must be an absolute path"),
        ({"max_memory": {"0": 1 << 30}}, "applies to placement 'accelerate' only"),
        ({"dtype": "float64"}, "unknown dtype"),
        ({"colour": "red"}, "unknown field"),
    ]
    for change, message in cases:
        with pytest.raises(BadInputError, match=message):
            pool4.request("load_text_encoder", {**params, **change}, timeout=60)
    # a placement the schema does not know is refused by the pool even from a client that skips the check
    with raw_connect(pool4.dir) as s:
        raw_hello(s, pool4.dir)
        protocol.send_frame(s, {"type": "load_text_encoder", "id": "p1", "params": {**params, "placement": "ring"}})
        answer = read_answer(s)
        assert answer["event"] == "error" and answer["kind"] == "bad_input" and "placement" in answer["message"]

    # found only by loading (a damaged weights file): every rank that loads fails, all answer bad_input
    damaged = tmp_path / "damaged-gemma"
    shutil.copytree(tiny_gemma_dir, damaged)
    weights = next(damaged.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(BadInputError, match=r"loading the text encoder on cpu failed: .*\(on rank 0 and 3 more\)"):
        pool4.request("load_text_encoder", {**params, "source": str(damaged)}, timeout=60)

    # found by one rank only (prompt 1 is rank 1's; too long with truncate off): agreed, bad_input everywhere
    strict = PoolTextEncoder(tiny_gemma_dir, checkpoints["2.3"], placement="batch_parallel", dtype="float32",
                             token_budget=8, truncate=False)
    with pytest.raises(BadInputError, match=r"PromptTooLongError.*\(on rank 1\)"):
        _encode(pool4, strict, ["a", PROMPTS[2], "b", "c"], batch_size=1)
    with pytest.raises(BadInputError, match="another client loaded a different one"):
        pool4.request("encode", {"prompts": ["x"], "expect": "text:someone-else"}, timeout=60)
    pool4.request("unload", {"names": None}, timeout=60)
    with pytest.raises(BadInputError, match="no text encoder is loaded"):
        pool4.request("encode", {"prompts": ["x"]}, timeout=60)

    result, tensors = _encode(pool4, good, PROMPTS[:1])  # still serving, every rank, the same pool
    assert pool4.pid == pid
    _check(result, tensors, _reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:1]), 4)


def test_load_request_checks_run_from_headers(tiny_gemma_dir, tiny_ltx_23):
    params = PoolTextEncoder(tiny_gemma_dir, tiny_ltx_23, placement="accelerate").load_params("k")
    req = parse_load_request({**params, "max_memory": {"0": "1GiB", "1": 2048}}, world_size=2, device_type="cuda")
    assert req.max_memory == {0: 1 << 30, 1: 2048} and req.version == "2.3" and req.width == 48
    with pytest.raises(BadInput, match="every device of the pool a budget"):
        parse_load_request({**params, "max_memory": {"0": 100}}, world_size=2, device_type="cuda")
    with pytest.raises(BadInput, match="placement must be one of"):
        parse_load_request({**params, "placement": "ring"}, world_size=2, device_type="cpu")


# --------------------------------------------------------------------------- the accelerate split


def test_accelerate_split_gives_every_device_layers_and_balances_bytes(tiny_gemma_dir):
    # Gemma 3 12B-shaped sizes: a 2 GB embedding, 48 layers of 0.45 GB (bf16) or 0.12 GB (NF4)
    for layer in (450, 120):
        for n in (2, 4, 8):
            counts = sharding.plan_layer_split([layer] * 48, head_bytes=2000, tail_bytes=0, budgets=[1] * n)
            loads = [c * layer + (2000 if d == 0 else 0) for d, c in enumerate(counts)]
            assert sum(counts) == 48 and min(counts) >= 1, counts
            assert max(loads) <= (48 * layer + 2000) / n + 2000, (layer, n, counts)  # within one embedding of even
    assert sharding.plan_layer_split([1] * 6, 0, 0, [1, 2]) == [2, 4]  # in proportion to the budgets

    from ltx_mgpu.text.gemma import load_gemma_text_tower

    model = load_gemma_text_tower(tiny_gemma_dir, dtype=torch.float32).model
    devices = [f"cuda:{i}" for i in range(4)]
    device_map = sharding.gemma_device_map(model, devices)
    layers = sharding.describe_device_map(device_map)
    assert sorted(layers) == devices and all(layers[d] for d in devices)
    assert device_map["embed_tokens"] == "cuda:0" and device_map["norm"] == "cuda:3"
    with pytest.raises(ValueError, match="over its max_memory"):
        sharding.gemma_device_map(model, devices[:2], max_memory={0: 1000, 1: 1000})
    with pytest.raises(ValueError, match="cannot give each of 8 device"):
        sharding.gemma_device_map(model, [f"cuda:{i}" for i in range(8)])


def test_contiguous_split_puts_the_remainder_on_the_first_ranks():
    assert tp.split_contiguous(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert tp.prompt_owners(2, 4, "batch_parallel") == [0, 1]
    assert tp.prompt_owners(3, 4, "single") == [0, 0, 0]


# --------------------------------------------------------------------------- client-side cache


def test_fully_cached_request_makes_no_pool_call(tiny_gemma_dir, tiny_ltx_23, tmp_path):
    cache = EmbeddingCache(tmp_path / "cache")
    spec = TextEncoderSpec(tiny_gemma_dir, tiny_ltx_23, dtype="float32")
    cached, _ = encode_in_process(spec, PROMPTS[:3], cache=cache)
    nowhere = short_dir()
    try:  # no pool runs there and this client may not start one: any request raises PoolError
        client = PoolClient(launch.resolve_spec("cpu", 2, "with-owner", nowhere), start=False)
        encoder = PoolTextEncoder.from_spec(spec, placement="batch_parallel")
        got, report = client.encode_prompts(encoder, PROMPTS[:3] + PROMPTS[:1], cache=cache)
        assert (report.hits, report.misses, report.encoded) == (3, 0, 0)
        assert [torch.equal(g.tensor, c.tensor) for g, c in zip(got, cached + cached[:1])] == [True] * 4
        assert list(nowhere.iterdir()) == []  # nothing was started or even created
        with pytest.raises(PoolError, match="no pool runs"):  # one miss: the pool would be contacted
            client.encode_prompts(encoder, PROMPTS[:4], cache=cache)
    finally:
        cleanup(nowhere)


def test_only_the_misses_go_to_the_pool(pool2, tiny_gemma_dir, tiny_ltx_23, tmp_path):
    cache = EmbeddingCache(tmp_path / "cache")
    spec = TextEncoderSpec(tiny_gemma_dir, tiny_ltx_23, dtype="float32")
    encode_in_process(spec, PROMPTS[:1], cache=cache)
    encoder = PoolTextEncoder.from_spec(spec, placement="single")
    got, report = encode_prompts(pool2, encoder, PROMPTS[:3], cache=cache, batch_size=2)
    assert (report.hits, report.encoded) == (1, 2)
    for g, ref in zip(got, _reference(tiny_gemma_dir, tiny_ltx_23, PROMPTS[:3])):
        torch.testing.assert_close(g.tensor, ref.tensor, rtol=1e-5, atol=1e-5)
    assert cache.stats.writes == 3  # the pool's two are cached now
    again, report = encode_prompts(pool2, encoder, PROMPTS[:3], cache=cache)
    assert report.encoded == 0 and all(torch.equal(a.tensor, g.tensor) for a, g in zip(again, got))


def test_a_text_encoder_swapped_by_another_client_is_reloaded(pool2, base, tiny_gemma_dir, checkpoints):
    mine = PoolTextEncoder(tiny_gemma_dir, checkpoints["2.0"], dtype="float32")
    theirs = PoolTextEncoder(tiny_gemma_dir, checkpoints["2.3"], dtype="float32")
    other = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, start=False)
    swaps = []

    def on_progress(phase, step, total):  # while our load finishes, another client queues its own
        if phase == "load_text_encoder" and step == total and not swaps:
            swaps.append(other.submit("load_text_encoder", theirs.load_params(theirs.key())))
            assert next(swaps[0].events(timeout=30))["event"] == "accepted"  # queued before our encode

    try:
        got, report = encode_prompts(pool2, mine, PROMPTS[:2], on_progress=on_progress)
        assert swaps and swaps[0].wait(timeout=60)[0]["key"] == theirs.key()  # it ran before our encode
    finally:
        other.close()
    assert report.encoded == 2
    for g, ref in zip(got, _reference(tiny_gemma_dir, checkpoints["2.0"], PROMPTS[:2])):
        torch.testing.assert_close(g.tensor, ref.tensor, rtol=1e-5, atol=1e-5)
    assert pool2.status()["ranks"][0]["models"]["text_encoder"]["key"] == mine.key()


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
    for e, ref in zip(embeddings, _reference(tiny_gemma_dir, tiny_ltx_20, prompts)):
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
    ref = _reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:2])
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.tensor, r.tensor, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- the wire: dtype and shared memory


def test_encode_results_come_through_the_arena_and_bf16_on_the_wire_is_exact(tiny_gemma_dir, checkpoints,
                                                                             monkeypatch):
    """float32 (a CPU pool) and bf16 results, through the shared arena (every payload: min bytes 1)
    and the socket, give the float32 a client expects, bit for bit."""
    monkeypatch.setenv("LTX_MGPU_SHM_MIN_BYTES", "1")  # read by the pool started below
    rt = short_dir()
    try:
        client = PoolClient.connect(gpus="cpu", nproc=1, runtime_dir=rt, startup_timeout=120)
        plain = PoolClient.connect(gpus="cpu", nproc=1, runtime_dir=rt, start=False, shm=False)
        encoder = PoolTextEncoder(tiny_gemma_dir, checkpoints["2.3"], dtype="float32")
        ref = _reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:3], batch_size=2)
        got, _ = encode_prompts(client, encoder, PROMPTS[:3], batch_size=2)  # receive=upcast, from the arena
        assert client.shm_stats["frames"] >= 1
        for g, r in zip(got, ref):
            assert g.tensor.dtype == torch.float32 and torch.equal(g.tensor, r.tensor)
        got, _ = encode_prompts(plain, encoder, PROMPTS[:3], batch_size=2)
        assert all(torch.equal(g.tensor, r.tensor) for g, r in zip(got, ref))
        # bf16 on the wire (what a bf16 pool sends: its encoder's rows in bf16, of which the
        # float32 embeddings are upcasts): the client's upcast restores the rows exactly.
        rows = [r.tensor.bfloat16().float() for r in ref] + [torch.randn(700, 6144).bfloat16().float()]
        wire = {f"prompt_{i}": t.to(torch.bfloat16) for i, t in enumerate(rows)}
        assert all(w.dtype == torch.bfloat16 for w in wire.values())
        result = {"count": len(rows), "version": "2.3", "dropped_tokens": [0] * len(rows)}
        for c, receive in ((client, upcast), (client, None), (plain, None)):
            frames = c.shm_stats["frames"]
            _, echoed = c.request("selftest", {"steps": 0, "echo": True}, tensors=wire, receive=receive, timeout=60)
            assert c.shm_stats["frames"] == frames + (c is client)
            for e, want in zip(embeddings_from_result(result, echoed), rows):
                assert e.tensor.dtype == torch.float32 and torch.equal(e.tensor, want)
        plain.close()
        client.shutdown()
    finally:
        cleanup(rt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the GPU machine)")
def test_bf16_pool_on_one_gpu_sends_float32_and_gives_the_in_process_embeddings_bit_for_bit(tiny_gemma_dir,
                                                                                          checkpoints):
    rt = short_dir()
    try:
        client = PoolClient.connect(gpus=[0], runtime_dir=rt, startup_timeout=300)
        spec = TextEncoderSpec(tiny_gemma_dir, checkpoints["2.3"], device="cuda:0", dtype="bfloat16")
        ref = spec.build().encode(PROMPTS[:3], batch_size=2)
        encoder = PoolTextEncoder.from_spec(spec)
        result, tensors = _encode(client, encoder, PROMPTS[:3], verify=False)
        # world size 1: float32 straight from the encoder (nothing is broadcast in bf16)
        assert result["wire_dtype"] == "float32" and all(t.dtype == torch.float32 for t in tensors.values())
        for e, r in zip(embeddings_from_result(result, tensors), ref):
            assert e.tensor.dtype == torch.float32 and torch.equal(e.tensor, r.tensor)
        got, _ = encode_prompts(client, encoder, PROMPTS[:3], batch_size=2)
        assert all(torch.equal(g.tensor, r.tensor) for g, r in zip(got, ref))
        client.shutdown()
    finally:
        cleanup(rt)
