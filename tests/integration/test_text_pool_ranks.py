"""Gemma across a 4-rank pool with real processes (CPU ranks on gloo): batch-parallel splits keep
prompt order with more ranks than prompts or an uneven split; bad input is rejected on every rank and
the pool keeps serving. Also the splits planned without a pool: load-request checks, the accelerate
layer split, the contiguous prompt split. The pool is shared by the tests of this file."""

from __future__ import annotations

import shutil

import pytest
import torch
from pool_support import raw_connect, raw_hello, read_answer
from safetensors.torch import save_file
from text_pool_support import PROMPTS, check, encode, reference

from ltx_mgpu import wire
from ltx_mgpu.client.errors import BadInputError
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.pool.engines import BadInput
from ltx_mgpu.pool.text_jobs import parse_load_request
from ltx_mgpu.text.config import TextEncoderConfig
from ltx_mgpu.text.encoder import device_map as device_maps
from ltx_mgpu.text.encoder import placement as tp


@pytest.fixture(scope="module")
def pool4(base):
    client = PoolClient.connect(gpus="cpu", nproc=4, runtime_dir=base, startup_timeout=180)
    yield client
    client.shutdown()


# --------------------------------------------------------------------------- batch-parallel splits


def test_batch_parallel_with_more_ranks_than_prompts(pool4, tiny_gemma_dir, checkpoints):
    encoder = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], placement="batch_parallel", dtype="float32")
    result, tensors = encode(pool4, encoder, PROMPTS[:2])
    assert result["owners"] == [0, 1]  # ranks 2 and 3 encode nothing but still receive both
    check(result, tensors, reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:2]), 4)


def test_batch_parallel_uneven_split_keeps_prompt_order(pool4, tiny_gemma_dir, checkpoints):
    encoder = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.0"], placement="batch_parallel", dtype="float32")
    result, tensors = encode(pool4, encoder, PROMPTS, batch_size=1)
    assert result["owners"] == [0, 0, 1, 1, 2, 2, 3]  # 7 over 4: the remainder to the first ranks
    check(result, tensors, reference(tiny_gemma_dir, checkpoints["2.0"], PROMPTS), 4)
    assert result["broadcast_bytes"] == sum(t.numel() * 4 for t in tensors.values())


# --------------------------------------------------------------------------- bad input


def test_bad_input_is_rejected_on_every_rank_and_the_pool_keeps_serving(pool4, tiny_gemma_dir, checkpoints, tmp_path):
    pid = pool4.pid
    good = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], placement="batch_parallel", dtype="float32")
    params = good.to_params("k")
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
        ({"compile": True, "weights": "nf4", "dtype": "bfloat16"}, "compile works with bf16 weights"),
        ({"compile": True, "placement": "accelerate"}, "compile runs with placement 'single' or 'batch_parallel'"),
        ({"compile": "yes"}, "compile"),
    ]
    for change, message in cases:
        with pytest.raises(BadInputError, match=message):
            pool4.request("load_text_encoder", {**params, **change}, timeout=60)
    # a placement the pool does not know is refused by the pool (its TextEncoderConfig: the one check
    # of the values) even from a client that skips the client's check
    with raw_connect(pool4.dir) as s:
        raw_hello(s, pool4.dir)
        wire.send_frame(s, {"type": "load_text_encoder", "id": "p1", "params": {**params, "placement": "ring"}})
        answer = read_answer(s)
        while answer["event"] in ("accepted", "progress", "log"):
            answer = read_answer(s)
        assert answer["event"] == "error" and answer["kind"] == "bad_input", answer
        assert "placement must be one of" in answer["message"], answer

    # found only by loading (a damaged weights file): every rank that loads fails, all answer bad_input
    damaged = tmp_path / "damaged-gemma"
    shutil.copytree(tiny_gemma_dir, damaged)
    weights = next(damaged.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(BadInputError, match=r"loading the text encoder on cpu failed: .*\(on rank 0 and 3 more\)"):
        pool4.request("load_text_encoder", {**params, "source": str(damaged)}, timeout=60)

    # found by one rank only (prompt 1 is rank 1's; too long with truncate off): agreed, bad_input everywhere
    strict = TextEncoderConfig(tiny_gemma_dir, checkpoints["2.3"], placement="batch_parallel", dtype="float32",
                             token_budget=8, truncate=False)
    with pytest.raises(BadInputError, match=r"PromptTooLongError.*\(on rank 1\)"):
        encode(pool4, strict, ["a", PROMPTS[2], "b", "c"], batch_size=1)
    with pytest.raises(BadInputError, match="another client loaded a different one"):
        pool4.request("encode", {"prompts": ["x"], "expect": "text:someone-else"}, timeout=60)
    pool4.request("unload", {"names": None}, timeout=60)
    with pytest.raises(BadInputError, match="no text encoder is loaded"):
        pool4.request("encode", {"prompts": ["x"]}, timeout=60)

    result, tensors = encode(pool4, good, PROMPTS[:1])  # still serving, every rank, the same pool
    assert pool4.pid == pid
    check(result, tensors, reference(tiny_gemma_dir, checkpoints["2.3"], PROMPTS[:1]), 4)


def test_load_request_checks_run_from_headers(tiny_gemma_dir, tiny_ltx_23):
    params = TextEncoderConfig(tiny_gemma_dir, tiny_ltx_23, placement="accelerate").to_params("k")
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
            counts = device_maps.plan_layer_split([layer] * 48, head_bytes=2000, tail_bytes=0, budgets=[1] * n)
            loads = [c * layer + (2000 if d == 0 else 0) for d, c in enumerate(counts)]
            assert sum(counts) == 48 and min(counts) >= 1, counts
            assert max(loads) <= (48 * layer + 2000) / n + 2000, (layer, n, counts)  # within one embedding of even
    assert device_maps.plan_layer_split([1] * 6, 0, 0, [1, 2]) == [2, 4]  # in proportion to the budgets

    from ltx_mgpu.text.encoder.loading import load_gemma_text_tower

    model = load_gemma_text_tower(tiny_gemma_dir, dtype=torch.float32).model
    devices = [f"cuda:{i}" for i in range(4)]
    device_map = device_maps.gemma_device_map(model, devices)
    layers = device_maps.describe_device_map(device_map)
    assert sorted(layers) == devices and all(layers[d] for d in devices)
    assert device_map["embed_tokens"] == "cuda:0" and device_map["norm"] == "cuda:3"
    with pytest.raises(ValueError, match="over its max_memory"):
        device_maps.gemma_device_map(model, devices[:2], max_memory={0: 1000, 1: 1000})
    with pytest.raises(ValueError, match="cannot give each of 8 device"):
        device_maps.gemma_device_map(model, [f"cuda:{i}" for i in range(8)])


def test_contiguous_split_puts_the_remainder_on_the_first_ranks():
    assert tp.split_contiguous(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    assert tp.prompt_owners(2, 4, "batch_parallel") == [0, 1]
    assert tp.prompt_owners(3, 4, "single") == [0, 0, 0]
