"""Encode results on the wire, each test with its own pool: float32 and bf16 through the shared-memory
arena and the socket reach the client bit for bit; a bf16 pool on one GPU sends float32."""

from __future__ import annotations

import time

import pytest
import torch
from pool_support import cleanup, pool_pids, running, short_dir
from text_pool_support import PROMPTS, encode, reference

from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.client.text import embeddings_from_result, encode_prompts, pool_key, upcast
from ltx_mgpu.text.config import TextEncoderConfig
from ltx_mgpu.text.encoder.local import LocalTextEncoder

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
        encoder = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], dtype="float32")
        ref = reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:3], batch_size=2)
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


@pytest.mark.filterwarnings("ignore:prompt . is longer than")
def test_a_one_rank_pool_writes_the_rows_into_the_memory_it_hands_over(tiny_gemma_dir, checkpoints, monkeypatch):
    """keep=False at world size 1 (what the ComfyUI node sends): once a spare is ready, the
    encoder writes the float32 rows straight into the shared memory that is handed over
    (``rows_in_place``), and the client gets the in-process embeddings bit for bit in memory of
    its own; with keep=True (the pool holds the rows resident) the rows are never the client's."""
    monkeypatch.setenv("LTX_MGPU_SHM_MIN_BYTES", "1")  # read by the pool started below
    monkeypatch.setenv("LTX_MGPU_SHM_OWN_MIN_BYTES", "1")
    rt = short_dir()
    try:
        client = PoolClient.connect(gpus="cpu", nproc=1, runtime_dir=rt, startup_timeout=120)
        encoder = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.0"], dtype="float32")
        # prompts at the token budget: a spare is handed over only when it fits within 2x (shm.fits)
        prompts = [(p + " ") * 100 for p in PROMPTS[:3]]
        ref = reference(tiny_gemma_dir, checkpoints["2.0"], prompts, batch_size=2)
        assert sum(r.tensor.numel() * 4 for r in ref) > 1 << 19
        key = pool_key(encoder)
        encode(client, encoder, prompts)  # loads; its result is the first large payload
        seen = []
        for _ in range(20):  # the spare is made in the background after each large result
            result, tensors = client.request("encode", {"prompts": prompts, "batch_size": 2, "expect": key,
                                                        "keep": False}, timeout=120)
            seen.append(result["rows_in_place"])
            for e, r in zip(embeddings_from_result(result, tensors), ref):
                assert e.tensor.dtype == torch.float32 and torch.equal(e.tensor, r.tensor)
            if seen[-1]:
                break
            time.sleep(0.2)
        assert seen[-1], f"never written in place: {seen}"
        assert client.shm_stats["owned"] >= 1
        for t in tensors.values():
            t.zero_()  # the client's to write: the next result is unaffected
        result, tensors = client.request("encode", {"prompts": prompts, "batch_size": 2, "expect": key,
                                                    "keep": True}, timeout=120)
        assert result["rows_in_place"] is False
        for e, r in zip(embeddings_from_result(result, tensors), ref):
            assert torch.equal(e.tensor, r.tensor)
        client.shutdown()
    finally:
        cleanup(rt)


def test_a_compiled_text_encoder_in_the_pool_gives_the_eager_embeddings(tiny_gemma_dir, checkpoints):
    """TextEncoderConfig(compile=True): the pool's Gemma runs its layers through torch.compile
    (Inductor on a CPU rank here); the embeddings equal the in-process eager ones to float32
    rounding, the status says so, and the client refuses compile with accelerate up front."""
    rt = short_dir()
    try:
        client = PoolClient.connect(gpus="cpu", nproc=1, runtime_dir=rt, startup_timeout=120)
        encoder = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], dtype="float32", compile=True)
        assert pool_key(encoder) != pool_key(TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], dtype="float32"))
        ref = reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:3], batch_size=2)
        got, _ = encode_prompts(client, encoder, PROMPTS[:3], batch_size=2)
        for g, r in zip(got, ref):
            torch.testing.assert_close(g.tensor, r.tensor, rtol=1e-4, atol=1e-4)
        assert client.status()["ranks"][0]["models"]["text_encoder"]["compile"] is True
        with pytest.raises(ValueError, match="compile runs with placement"):
            TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], placement="accelerate", compile=True)
        client.shutdown()
    finally:
        cleanup(rt)


def test_a_compiler_that_fails_in_the_pool_is_bad_input_and_the_pool_keeps_serving(tiny_gemma_dir, checkpoints,
                                                                                   monkeypatch, tmp_path):
    """A pool whose torch.compile cannot work (no C++ compiler for Inductor's CPU backend here)
    answers a compile=True load with bad_input naming the fix, at load, and serves on: the same
    encoder without compile loads and encodes."""
    from ltx_mgpu.client.errors import BadInputError

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))  # read by the pool started below
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # nothing compiled before
    rt = short_dir()
    try:
        client = PoolClient.connect(gpus="cpu", nproc=1, runtime_dir=rt, startup_timeout=120)
        pids = pool_pids(client)
        broken = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], dtype="float32", compile=True)
        with pytest.raises(BadInputError, match="torch.compile could not compile Gemma's layers.*turn compile off"):
            encode_prompts(client, broken, PROMPTS[:2], batch_size=2)
        plain = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], dtype="float32")
        got, _ = encode_prompts(client, plain, PROMPTS[:2], batch_size=2)
        assert len(got) == 2 and running(pids) == [p for p, _ in pids]
        client.shutdown()
    finally:
        cleanup(rt)


@pytest.mark.filterwarnings("ignore:prompt . is longer than")
@pytest.mark.parametrize("how", ["client gone", "idle drop"])
def test_a_reservation_taken_away_mid_job_leaves_the_pool_serving(tiny_gemma_dir, checkpoints, monkeypatch, how):
    """A keep=False encode in several rounds has its rows set aside in shared memory after the
    first; the client disconnecting, or the idle drop (1 s here), takes that memory away from
    the connection while the job still writes rows into it. The pool must go on serving (it
    crashed rank 0 with SIGSEGV when dropping unmapped the memory)."""
    monkeypatch.setenv("LTX_MGPU_SHM_MIN_BYTES", "1")
    monkeypatch.setenv("LTX_MGPU_SHM_OWN_MIN_BYTES", "1")
    if how == "idle drop":
        monkeypatch.setenv("LTX_MGPU_SHM_IDLE_SECONDS", "1.0")
    rt = short_dir()
    try:
        client = PoolClient.connect(gpus="cpu", nproc=1, runtime_dir=rt, startup_timeout=120)
        pids = pool_pids(client)
        encoder = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.0"], dtype="float32")
        prompts = [(p + " ") * 100 for p in PROMPTS] * 6  # 42 prompts at the token budget
        result, _ = encode(client, encoder, prompts, batch_size=64, verify=False)  # a spare is made after it
        time.sleep(0.3)

        def on_progress(phase, step, total):
            if how == "client gone" and step == 2:
                client._sock.shutdown(2)

        params = {"prompts": prompts, "expect": pool_key(encoder), "keep": False}
        try:
            client.request("encode", {**params, "batch_size": 1 if how == "client gone" else 6},
                           on_progress=on_progress, timeout=120)
        except Exception:  # noqa: BLE001 - the client closed its own socket
            assert how == "client gone"
        time.sleep(1.0)
        assert running(pids) == [p for p, _ in pids], "the pool lost a process"
        other = PoolClient.connect(gpus="cpu", nproc=1, runtime_dir=rt, start=False)
        got, _ = encode(other, encoder, PROMPTS[:2], verify=False)
        assert got["count"] == 2
        other.shutdown()
    finally:
        cleanup(rt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)")
def test_bf16_pool_on_one_gpu_sends_float32_and_gives_the_in_process_embeddings_bit_for_bit(tiny_gemma_dir,
                                                                                          checkpoints):
    rt = short_dir()
    try:
        client = PoolClient.connect(gpus=[0], runtime_dir=rt, startup_timeout=300)
        spec = LocalTextEncoder(TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], dtype="bfloat16"), "cuda:0")
        ref = spec.build().encode(PROMPTS[:3], batch_size=2)
        encoder = spec.config
        result, tensors = encode(client, encoder, PROMPTS[:3], verify=False)
        # world size 1: float32 straight from the encoder (nothing is broadcast in bf16)
        assert result["wire_dtype"] == "float32" and all(t.dtype == torch.float32 for t in tensors.values())
        for e, r in zip(embeddings_from_result(result, tensors), ref):
            assert e.tensor.dtype == torch.float32 and torch.equal(e.tensor, r.tensor)
        got, _ = encode_prompts(client, encoder, PROMPTS[:3], batch_size=2)
        assert all(torch.equal(g.tensor, r.tensor) for g, r in zip(got, ref))
        client.shutdown()
    finally:
        cleanup(rt)
