"""The pool's error contract against hostile requests: no schema-valid request kills the pool.

One real 2-rank CPU pool for the module, with the tiny LTX-2.3 transformer and the tiny Gemma
(``batch_parallel``: both ranks hold it) loaded. Each test sends requests a security review found
fatal or wedging, through ``PoolClient.request`` with hand-made params and tensors, or through a
raw connection (:func:`hostile`) where the client's own schema check would refuse them first, and
checks that the pool answers ``bad_input`` naming the field and the fix, that the same processes
still answer ``status`` and that a good request of the same kind still works. The size bounds
(``ltx_mgpu.wire.messages``: ``MAX_STEPS`` ...) are refused up front, before any work: fast.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from pool_support import pool_pids, raw_connect, raw_hello, read_answer, running
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ltx_mgpu import wire
from ltx_mgpu.client import launch
from ltx_mgpu.client.denoise import SampleRequest, remote_load_transformer, remote_sample
from ltx_mgpu.client.errors import BadInputError, JobCancelledError, PoolError, PoolFatalError
from ltx_mgpu.client.model import PoolModel
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.client.text import ensure_text_encoder, pool_key
from ltx_mgpu.denoise.model import export_transformer_only
from ltx_mgpu.denoise.plan import TransformerPlan
from ltx_mgpu.nested import NestedTensorLike
from ltx_mgpu.text.config import TextEncoderConfig
from ltx_mgpu.wire.messages import MAX_BATCH, MAX_LORAS, MAX_PROMPTS, MAX_STEPS, MAX_TEXT_TOKENS

SIGMAS = torch.tensor([1.0, 0.5, 0.0])  # 2 steps
FAST = 5.0  # seconds: a generous bound for a refusal made before any work (it takes milliseconds)


# --------------------------------------------------------------------------- the pool


class Pool:
    """The module's pool: its client, processes, text-encoder key and checkpoint."""

    def __init__(self, base: Path, ckpt: Path, gemma: Path):
        self.base, self.ckpt = base, str(ckpt)
        self.encoder = TextEncoderConfig(gemma, ckpt, placement="batch_parallel", dtype="float32")
        self.key = pool_key(self.encoder)
        self.client: PoolClient | None = None
        self.pids: list = []
        self.restarts = 0
        self.start()

    def start(self) -> None:
        self.client = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=self.base, lifetime="with-owner",
                                         startup_timeout=120)
        remote_load_transformer(self.client, TransformerPlan(self.ckpt, dtype="fp32"), timeout=120)
        ensure_text_encoder(self.client, self.encoder, self.key, timeout=120)
        self.pids = pool_pids(self.client)

    def alive(self) -> bool:
        """The same processes answer, idle (a wedged job would hold up the next test)."""
        if running(self.pids) != [pid for pid, _ in self.pids]:
            return False
        try:
            status = self.client.status(timeout=5)
        except PoolError:
            return False
        return status["current"] is None and [r["pid"] for r in status["ranks"]] == [p for p, _ in self.pids[1:]]

    def restart(self) -> None:
        """A finding killed or wedged the pool (before its fix): a fresh one for the next test."""
        self.restarts += 1
        self.client.kill("the previous test left the pool dead or busy")
        self.client.close()
        self.start()

    def assert_held(self) -> None:
        """The pool that answered is the module's: the same torchrun and ranks, idle."""
        assert self.alive(), "the pool died or is still busy"
        assert pool_pids(self.client) == self.pids


@pytest.fixture(scope="module")
def pool(base, tiny_ltx_23, tiny_gemma_dir):
    p = Pool(base, tiny_ltx_23, tiny_gemma_dir)
    try:
        yield p
    finally:
        p.client.shutdown()


@pytest.fixture(autouse=True)
def _live(pool):
    if not pool.alive():
        pool.restart()
    yield


def hostile(pool: Pool, mtype: str, params: dict, tensors: dict | None = None, timeout: float = 30.0) -> dict:
    """Send a request the way a client that skips every client-side check would (a raw frame on
    a connection of its own) and wait for its answer: the result, or the ``PoolError`` its
    ``error`` event maps to."""
    sock = raw_connect(pool.client.dir)
    try:
        raw_hello(sock, pool.client.dir)
        rid = uuid.uuid4().hex
        wire.send_frame(sock, {"type": mtype, "id": rid, "params": params}, wire.tensors_to_payload(tensors))
        deadline = time.monotonic() + timeout
        while True:
            header = read_answer(sock, max(0.1, deadline - time.monotonic()))
            if header is None:
                raise PoolFatalError("the pool closed the connection")
            if header.get("id") != rid:
                continue
            if header["event"] == "result":
                return header["result"]
            if header["event"] == "error":
                kind = header["kind"]
                cls = {"bad_input": BadInputError, "cancelled": JobCancelledError}.get(kind, PoolFatalError)
                raise cls(header["message"])
    finally:
        sock.close()


def refused(call, match: str, fast: bool = False) -> str:
    """``call()`` raises ``BadInputError`` matching ``match`` (within :data:`FAST` seconds with
    ``fast``); returns the message."""
    t0 = time.monotonic()
    with pytest.raises(BadInputError, match=match) as e:
        call()
    if fast:
        assert time.monotonic() - t0 < FAST, f"the refusal took {time.monotonic() - t0:.1f} s: the work started"
    return str(e.value)


# --------------------------------------------------------------------------- inputs


def _cond(tokens: int = 9, seed: int = 1, **extra):
    t = torch.randn(1, tokens, 48, generator=torch.Generator().manual_seed(seed))
    return [[t, {"pooled_output": None, "unprocessed_ltxav_embeds": True, **extra}]]


def _av_latent(video=(1, 128, 3, 3, 5), audio=(1, 8, 7, 16), mask=None, **keys):
    g = torch.Generator().manual_seed(11)
    out = {"samples": NestedTensorLike([torch.randn(*video, generator=g), torch.randn(*audio, generator=g)]),
           "type": "audio", **keys}
    if mask is not None:
        out["noise_mask"] = NestedTensorLike([torch.ones(mask[0]), torch.ones(mask[1])])
    return out


def _wire(latent=None, cond=None, sigmas=SIGMAS, **fields) -> tuple[dict, dict]:
    """A ``sample`` request's (params, tensors), as SampleRequest lays it out, then ``fields`` set."""
    req = SampleRequest(cond or _cond(), None, latent or _av_latent(), sigmas=sigmas)
    params, tensors = req.to_wire()
    params.update(fields)
    return params, tensors


def _samples_well(pool: Pool) -> None:
    out = remote_sample(pool.client, SampleRequest(_cond(), None, _av_latent(), sigmas=SIGMAS), timeout=60)
    assert [tuple(t.shape) for t in out["samples"].tensors] == [(1, 128, 3, 3, 5), (1, 8, 7, 16)]
    assert all(bool(torch.isfinite(t).all()) for t in out["samples"].tensors)


def _encodes_well(pool: Pool) -> None:
    result, tensors = pool.client.request("encode", {"prompts": ["a cat", "café"], "expect": pool.key}, timeout=60)
    assert result["count"] == 2 and tensors["prompt_1"].shape[-1] == 48


def _loads_well(pool: Pool) -> None:
    assert remote_load_transformer(pool.client, TransformerPlan(pool.ckpt, dtype="fp32"), timeout=60)["reused"] is True


# --------------------------------------------------------------------------- text


def test_a_prompt_that_is_not_unicode_text_is_bad_input(pool):
    # what `encode --pool --prompt $'caf\xff'` sends: the byte 0xff of a non-UTF-8 argument
    # reaches Python as the lone surrogate U+DCFF
    for params in ({"prompts": ["caf\udcff"]}, {"prompts": ["a cat", "\ud800"], "expect": pool.key, "batch_size": 1}):
        message = refused(lambda params=params: pool.client.request("encode", params, timeout=30),
                          r"prompts\[\d\] is not valid Unicode text")
        assert "UTF-8" in message
        pool.assert_held()
    _encodes_well(pool)


def test_the_prompt_count_and_batch_size_are_bounded_up_front(pool):
    too_many = {"prompts": ["a"] * (MAX_PROMPTS + 1), "expect": pool.key}
    refused(lambda: hostile(pool, "encode", too_many), rf"encode\.prompts .*at most {MAX_PROMPTS}", fast=True)
    huge_batch = {"prompts": ["a"], "batch_size": 10 ** 12, "expect": pool.key}
    refused(lambda: hostile(pool, "encode", huge_batch), rf"encode\.batch_size must be in 1\.\.{MAX_PROMPTS}",
            fast=True)
    params = {**pool.encoder.to_params(pool.key), "token_budget": 10 ** 9}
    refused(lambda: hostile(pool, "load_text_encoder", params), r"load_text_encoder\.token_budget must be in 1\.\.",
            fast=True)
    pool.assert_held()
    _encodes_well(pool)


# --------------------------------------------------------------------------- sample: options and sizes


@pytest.mark.parametrize("scheduler, match", [
    ({"max_shift": "x"}, r"scheduler\.max_shift must be a number"),
    ({"max_shift": None}, r"scheduler\.max_shift must be a number"),
    ({"stretch": None}, r"scheduler\.stretch must be true or false"),
    ({"terminal": {"a": 1}}, r"scheduler\.terminal must be a number"),
    ({"base_shift": [1]}, r"scheduler\.base_shift must be a number"),
    ({"stretch": 1}, r"scheduler\.stretch must be true or false"),
    ({"terminal": 1.0}, r"scheduler\.terminal must be in 0\.\.0\.99"),
    ({"max_shift": 1e6}, r"scheduler\.max_shift must be in 0\.\.100"),
], ids=["str", "null", "null_bool", "object", "list", "int_bool", "terminal_1", "huge_shift"])
def test_scheduler_options_of_the_wrong_type_or_range_are_bad_input(pool, scheduler, match):
    params, tensors = _wire(sigmas=None, steps=2, scheduler=scheduler)
    refused(lambda: pool.client.request("sample", params, tensors, timeout=30), match)
    pool.assert_held()


def test_steps_are_bounded_up_front(pool):
    for steps in (10 ** 12, 2 ** 62, 0):
        params, tensors = _wire(sigmas=None, steps=steps)
        refused(lambda params=params, tensors=tensors: hostile(pool, "sample", params, tensors),
                rf"sample\.steps must be in 1\.\.{MAX_STEPS}", fast=True)
    params, tensors = _wire(sigmas=torch.linspace(1, 0, MAX_STEPS + 2))
    refused(lambda: pool.client.request("sample", params, tensors, timeout=30),
            rf"sigmas .*{MAX_STEPS + 2} values.*at most {MAX_STEPS + 1}", fast=True)
    pool.assert_held()
    remote_sample(pool.client, SampleRequest(_cond(), None, _av_latent(), steps=2), timeout=60)


@pytest.mark.parametrize("latent, match", [
    (_av_latent(video=(0, 128, 3, 3, 5), audio=(0, 8, 7, 16)), r"latent part 0 \(video\) .*\(0, 128, 3, 3, 5\)"),
    (_av_latent(video=(1, 128, 0, 3, 5)), r"latent part 0 \(video\) .*\(1, 128, 0, 3, 5\)"),
    (_av_latent(audio=(1, 8, 0, 16)), r"latent part 1 \(audio\) .*\(1, 8, 0, 16\)"),
    ({"samples": torch.zeros(1, 8, 0, 16), "type": "audio"}, r"audio latent .*\(1, 8, 0, 16\)"),
    (_av_latent(mask=((1, 1, 0, 1, 1), (1, 1, 7, 1))), r"noise_mask part 0 \(video\) .*\(1, 1, 0, 1, 1\)"),
    (_av_latent(mask=((1, 1, 3, 1, 1), (1, 0, 7, 1))), r"noise_mask part 1 \(audio\) .*\(1, 0, 7, 1\)"),
    (_av_latent(batch_index=[]), r"batch_index has 0 entries; the latent's batch is 1"),
    (_av_latent(batch_index=[0, 1]), r"batch_index has 2 entries; the latent's batch is 1"),
], ids=["batch0", "frames0", "audio0", "audio_only0", "video_mask0", "audio_mask0", "batch_index_empty",
        "batch_index_long"])
def test_empty_shapes_are_bad_input(pool, latent, match):
    params, tensors = _wire(latent=latent)
    message = refused(lambda: pool.client.request("sample", params, tensors, timeout=30), match)
    assert "at least 1" in message or "one entry per" in message
    pool.assert_held()


def test_a_zero_dimensional_attention_mask_is_bad_input(pool):
    for mask in (torch.tensor(1.0), torch.ones(1, 9, 1)):
        params, tensors = _wire(cond=_cond(attention_mask=mask))
        refused(lambda params=params, tensors=tensors: pool.client.request("sample", params, tensors, timeout=30),
                r"positive conditioning's attention_mask must be \[batch, tokens\]")
        pool.assert_held()
    params, tensors = _wire(cond=_cond(attention_mask=torch.ones(1, 9)))
    pool.client.request("sample", params, tensors, timeout=60)


def test_conditioning_option_types_are_checked(pool):
    for extra, match in (({"unprocessed_ltxav_embeds": "yes"}, r"'unprocessed_ltxav_embeds' must be true or false"),
                         ({"frame_rate": True}, r"frame_rate must be a number")):
        params, tensors = _wire(cond=_cond(**extra))
        refused(lambda params=params, tensors=tensors: pool.client.request("sample", params, tensors, timeout=30),
                match)
    params, tensors = _wire()
    tensors["positive.0"] = tensors["positive.0"].to(torch.int32)
    refused(lambda: pool.client.request("sample", params, tensors, timeout=30), r"positive conditioning tensor")
    pool.assert_held()


def test_latent_sizes_are_bounded_before_any_work(pool):
    # a noise index of 10**7 made the sampler draw 10**7 noise tensors before its first step
    params, tensors = _wire(latent=_av_latent(batch_index=[10 ** 7]))
    refused(lambda: pool.client.request("sample", params, tensors, timeout=30),
            rf"latent\.batch_index values must be in 0\.\.{MAX_BATCH - 1}", fast=True)
    # a nested latent claiming 10**9 parts made the pool list 10**9 tensor names
    params, tensors = _wire()
    params["latent"]["parts"] = 10 ** 9
    refused(lambda: pool.client.request("sample", params, tensors, timeout=30),
            r"latent\.parts must be a part count of at most 2", fast=True)
    params["latent"]["parts"] = 0
    refused(lambda: pool.client.request("sample", params, tensors, timeout=30),
            r"latent\.parts must be 1\.\.2 for a nested latent", fast=True)
    params, tensors = _wire(latent=_av_latent(mask=((1, 1, 3, 1, 1), (1, 1, 7, 1))))
    params["latent"]["mask_parts"] = 10 ** 9
    refused(lambda: pool.client.request("sample", params, tensors, timeout=30),
            r"latent\.mask_parts must be a part count of at most 2", fast=True)
    params, tensors = _wire(cond=_cond(tokens=MAX_TEXT_TOKENS + 1))
    refused(lambda: pool.client.request("sample", params, tensors, timeout=30),
            rf"positive conditioning has {MAX_TEXT_TOKENS + 1} tokens, more than {MAX_TEXT_TOKENS}", fast=True)
    params, tensors = _wire(latent=_av_latent(audio=(1, 8, 32769, 16)))
    refused(lambda: pool.client.request("sample", params, tensors, timeout=30),
            r"audio latent has 32769 tokens.*max_tokens=32768", fast=True)
    params, tensors = _wire()
    tensors["latent.7"] = torch.zeros(1)
    refused(lambda: pool.client.request("sample", params, tensors, timeout=30),
            r"unexpected tensor\(s\) \['latent\.7'\]", fast=True)
    pool.assert_held()
    _samples_well(pool)


# --------------------------------------------------------------------------- load_transformer


@pytest.mark.parametrize("attention", ["xformers", "flash_attention_3", "triton_8bit"])
def test_an_attention_backend_the_pool_cannot_run_is_refused_at_load(pool, attention):
    plan = TransformerPlan(pool.ckpt, dtype="fp32", attention_type=attention)
    refused(lambda: remote_load_transformer(pool.client, plan, name="att", timeout=60),
            rf"attention_type '{attention}' cannot run on cpu.*'pytorch'")
    pool.assert_held()
    assert "att" not in pool.client.status()["ranks"][0]["models"]
    loaded = remote_load_transformer(pool.client, TransformerPlan(pool.ckpt, dtype="fp32", attention_type="pytorch"),
                                     name="att", timeout=60)
    assert loaded["reused"] is False
    remote_sample(pool.client, SampleRequest(_cond(), None, _av_latent(), model="att", sigmas=SIGMAS), timeout=60)
    pool.client.request("unload", {"names": ["att"]}, timeout=30)


def _lora(path: Path, a_shape=(2, 32), b_shape=(32, 2), key="transformer_blocks.0.attn1.to_q", fill=None,
          only_a=False) -> Path:
    g = torch.Generator().manual_seed(3)
    sd = {f"diffusion_model.{key}.lora_A.weight": torch.randn(*a_shape, generator=g)}
    if not only_a:
        sd[f"diffusion_model.{key}.lora_B.weight"] = torch.randn(*b_shape, generator=g)
    if fill is not None:
        sd[f"diffusion_model.{key}.lora_B.weight"].fill_(fill)
    save_file(sd, str(path))
    return path


def _not_safetensors(path: Path) -> Path:
    path.write_bytes(b"PK\x03\x04 a zip archive, not a LoRA" * 8)
    return path


def _truncated(path: Path) -> Path:
    _lora(path)
    data = path.read_bytes()
    path.write_bytes(data[:-64])
    return path


def _huge_header(path: Path) -> Path:
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    return path


BAD_LORAS = {
    "not_safetensors": (_not_safetensors, r"not a readable \.safetensors file"),
    "truncated": (_truncated, r"not a readable \.safetensors file"),
    "huge_header": (_huge_header, r"not a readable \.safetensors file"),
    "rank_mismatch": (lambda p: _lora(p, a_shape=(2, 32), b_shape=(32, 3)),
                      r"lora_A is \(2, 32\) \(rank 2\) but lora_B \(32, 3\) \(rank 3\)"),
    "one_d": (lambda p: _lora(p, a_shape=(64,)), r"lora_A .*\(64,\): a LoRA factor is 2-D"),
    "wrong_size": (lambda p: _lora(p, a_shape=(2, 31)), r"gives a \(32, 31\) update for a \(32, 32\) weight"),
    "nan": (lambda p: _lora(p, fill=float("nan")), r"lora_B holds NaN or infinite values"),
    "half_pair": (lambda p: _lora(p, only_a=True), r"has only one of lora_A/lora_B"),
    "ltx_2_0": (lambda p: _lora(p, key="caption_projection.linear_1", a_shape=(2, 64), b_shape=(32, 2)),
                r"match no weight of this LTX-2 transformer.*LTX-2\.0 vs 2\.3"),
}


@pytest.mark.parametrize("kind", list(BAD_LORAS))
def test_a_bad_lora_is_bad_input_naming_the_file(pool, tmp_path, kind):
    make, match = BAD_LORAS[kind]
    path = make(tmp_path / f"{kind}.safetensors")
    plan = TransformerPlan(pool.ckpt, dtype="fp32", loras=[(str(path), 1.0)])
    message = refused(lambda: remote_load_transformer(pool.client, plan, name="lora", timeout=60), match)
    assert path.name in message
    pool.assert_held()
    assert "lora" not in pool.client.status()["ranks"][0]["models"]


def _lying_fp8(pool: Pool, path: Path, how: str) -> str:
    """The module's checkpoint as ComfyUI scaled fp8, with one block weight that lies: a NaN e4m3
    byte in its last row (under ``weights: sharded`` only rank 1 reads it) or a row short."""
    fp8 = export_transformer_only(pool.ckpt, path.with_name("fp8.safetensors"), fp8="scaled")
    sd = load_file(str(fp8))
    key = "model.diffusion_model.transformer_blocks.1.attn1.to_q.weight"
    if how == "nan":
        sd[key].view(torch.uint8)[-1, -1] = 0x7F  # e4m3's NaN
    else:
        sd[key] = sd[key][:-1].contiguous()
    with safe_open(str(fp8), "pt") as f:
        save_file(sd, str(path), metadata=f.metadata())
    return str(path)


@pytest.mark.parametrize("how, match", [
    ("nan", r"transformer_blocks\.1\.attn1\.to_q\.weight holds NaN or infinite values; the file is damaged: download "
            r"it again"),
    ("short", r"transformer_blocks\.1\.attn1\.to_q\.weight is \[31, 32\]; the metadata LTX-2\.3 config makes it "
              r"\[32, 32\]: the file is damaged"),
])
@pytest.mark.parametrize("weights", ["replicated", "sharded"])
def test_an_fp8_file_that_lies_is_refused_at_load_naming_the_key(pool, tmp_path, how, match, weights):
    """Before: the NaN file loaded (both ways) and the forward returned NaN velocities; the short
    weight failed the sharded load with a raw size error naming nothing."""
    path = _lying_fp8(pool, tmp_path / f"{how}.safetensors", how)
    plan = TransformerPlan(path, dtype="fp32", weights=weights)
    refused(lambda: remote_load_transformer(pool.client, plan, name="liar", timeout=120), match)
    pool.assert_held()
    assert "liar" not in pool.client.status()["ranks"][0]["models"]
    _loads_well(pool)


def test_lora_lists_and_strengths_are_checked(pool, tmp_path):
    good = str(_lora(tmp_path / "good.safetensors"))
    params = {"checkpoint": pool.ckpt, "dtype": "fp32", "name": "lora",
              "loras": [{"path": good, "strength": 1.0}] * (MAX_LORAS + 1)}
    refused(lambda: hostile(pool, "load_transformer", params), rf"load_transformer\.loras .*at most {MAX_LORAS}",
            fast=True)
    for item, match in (({"path": good, "strength": 1e9}, r"loras\[0\]\.strength must be in -100\.\.100"),
                        ({"path": good, "strength": 1.0, "clip": 1}, r"loras\[0\] has unknown field\(s\) \['clip'\]")):
        params = {"checkpoint": pool.ckpt, "dtype": "fp32", "name": "lora", "loras": [item]}
        refused(lambda params=params: pool.client.request("load_transformer", params, timeout=30), match, fast=True)
    params = {"checkpoint": pool.ckpt, "dtype": "fp32", "max_tokens": 10 ** 12}
    refused(lambda: hostile(pool, "load_transformer", params), r"load_transformer\.max_tokens must be in 1\.\.",
            fast=True)
    pool.assert_held()
    loaded = remote_load_transformer(pool.client, TransformerPlan(pool.ckpt, dtype="fp32", loras=[(good, 0.5)]),
                                     name="lora", timeout=60)
    assert loaded["loras"] == [{"path": good, "strength": 0.5}]
    pool.client.request("unload", {"names": ["lora"]}, timeout=30)
    _loads_well(pool)


def test_the_command_line_with_a_non_utf8_prompt_gets_a_message(pool, tmp_path):
    # `encode --pool --gpus cpu --nproc 2 --prompt $'caf\xff'`: argv bytes that are not UTF-8
    gemma, projection = pool.encoder.gemma, pool.encoder.projection
    args = [sys.executable, "-m", "ltx_mgpu", "encode", "--pool", "--gpus", "cpu", "--nproc", "2",
            "--runtime-dir", str(pool.base), "--placement", "batch_parallel", "--dtype", "float32",
            "--gemma", str(gemma), "--projection", str(projection), "--no-cache", "--no-progress",
            "--out", str(tmp_path / "out.safetensors"), "--prompt"]
    out = subprocess.run([os.fsencode(a) for a in args] + [b"caf\xff"], cwd=launch.repo_root(), capture_output=True,
                         text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0 and "prompts[0] is not valid Unicode text" in out.stderr, out.stderr
    assert "send the prompt as UTF-8 text" in out.stderr
    pool.assert_held()
    ensure_text_encoder(pool.client, pool.encoder, pool.key, timeout=60)
    _encodes_well(pool)


def test_encode_with_damaged_weights_writes_no_nan_to_the_output_or_the_cache(pool, tmp_path):
    """``encode --pool`` with a Gemma snapshot whose decoder layer 1 holds a NaN weight (a file
    nothing checks at load: transformers reads it): before, the command exited 0 and wrote NaN
    embeddings to ``--out`` and to the cache, so every later hit returned NaN; now the pool's
    encode fails naming the prompt and the layer, nothing is written, and the pool serves on."""
    gemma = tmp_path / "gemma-nan"
    shutil.copytree(pool.encoder.gemma, gemma)
    weights = load_file(str(gemma / "model.safetensors"))
    weights["language_model.model.layers.1.mlp.down_proj.weight"][0, 0] = float("nan")
    save_file(weights, str(gemma / "model.safetensors"), metadata={"format": "pt"})
    cache, out_file = tmp_path / "cache", tmp_path / "out.safetensors"
    args = [sys.executable, "-m", "ltx_mgpu", "encode", "--pool", "--gpus", "cpu", "--nproc", "2",
            "--runtime-dir", str(pool.base), "--placement", "batch_parallel", "--dtype", "float32",
            "--gemma", str(gemma), "--projection", str(pool.encoder.projection), "--cache", str(cache),
            "--no-progress", "--out", str(out_file), "--prompt", "a cat"]
    out = subprocess.run(args, cwd=launch.repo_root(), capture_output=True, text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0, out.stdout + out.stderr
    assert ("prompt 0 ('a cat'): its embedding holds NaN or infinite values, from Gemma's hidden state 2 (the output "
            "of decoder layer 1, float32) on") in out.stderr, out.stderr
    assert not out_file.exists() and not [p for p in cache.rglob("*") if p.is_file()]
    pool.assert_held()
    ensure_text_encoder(pool.client, pool.encoder, pool.key, timeout=60)
    _encodes_well(pool)


def test_a_selftest_sleep_is_bounded(pool):
    refused(lambda: pool.client.request("selftest", {"steps": 1, "step_seconds": 1e300}, timeout=30),
            r"selftest step_seconds must be in 0\.\.60", fast=True)
    pool.assert_held()
    assert pool.client.request("selftest", {"steps": 1, "step_seconds": 0.01}, timeout=30)[0]["allreduce_ok"]


# --------------------------------------------------------------------------- forward (the MODEL path)


def _pool_model(pool: Pool, name: str = "ltx", **plan) -> PoolModel:
    """ComfyUI's MODEL as the Model Loader makes it, over the module's pool (its model, or one
    loaded under ``name`` with ``plan``'s options)."""
    def load():
        return remote_load_transformer(pool.client, TransformerPlan(pool.ckpt, dtype="fp32", **plan), name=name,
                                       timeout=120)

    return PoolModel(lambda: pool.client, load, name=name, key=load()["key"])


def _forward_inputs(video=(1, 128, 3, 3, 5), audio=(1, 8, 7, 16), t=(0.7, 0.7)):
    g = torch.Generator().manual_seed(11)
    x = [torch.randn(*video, generator=g), torch.randn(*audio, generator=g)]
    return x, tuple(torch.full((video[0],), v) if isinstance(v, float) else v for v in t)


def _guide_conds(**change):
    """ComfyUI's keyword arguments of a call with one keyframe guide on the last latent frame
    (strength 0.5, its first row masked out), ``change`` applied."""
    hh, ww = torch.meshgrid(torch.arange(3) * 32, torch.arange(5) * 32, indexing="ij")
    start = torch.stack([torch.full((3, 5), 8), hh, ww]).reshape(3, -1)
    kf = torch.stack([start, start + torch.tensor([1, 32, 32]).view(3, 1)], dim=-1).unsqueeze(0)
    mask = torch.ones(1, 128, 3, 3, 5)
    mask[:, :, 2] = 0.5
    mask[:, :, 2, 0] = -1.0
    entry = {"pre_filter_count": 15, "strength": 0.5, "pixel_mask": None, "latent_shape": [1, 3, 5]}
    entry.update(change.pop("entry", {}))
    return {"keyframe_idxs": kf, "denoise_mask": mask, "guide_attention_entries": [entry], **change}


@pytest.fixture(scope="module")
def model_call(pool):
    """The module's model as ComfyUI's MODEL, a processed text context, and one good call's
    velocities (what every call must still give after a refused one)."""
    pm = _pool_model(pool)
    ctx = pm.text_contexts(torch.randn(1, 9, 48, generator=torch.Generator().manual_seed(1)), True)
    x, t = _forward_inputs()
    return pm, ctx, pm.forward(x, t, ctx)


def _forwards_well(model_call) -> None:
    pm, ctx, want = model_call
    x, t = _forward_inputs()
    assert all(torch.equal(a, b) for a, b in zip(pm.forward(x, t, ctx), want, strict=True))


@pytest.mark.parametrize("inputs, match", [
    (_forward_inputs(video=(1, 7, 3, 3, 5)), r"x\[0\] \(the video latent\) has 7 channels; this model takes 128"),
    (_forward_inputs(audio=(1, 3, 7, 16)), r"x\[1\] \(the audio latent\) is \[1, 3, 7, 16\]: 3 channels x 16 mel bins"),
    (_forward_inputs(audio=(1, 8, 7, 7)), r"x\[1\] \(the audio latent\) is \[1, 8, 7, 7\]: .* this model takes 128"),
    (_forward_inputs(t=(-1.0, 0.7)), r"timestep\[0\] \(video\) holds from -1 to -1 .* 0\.\.1"),
    (_forward_inputs(t=(1e30, 0.7)), r"timestep\[0\] \(video\) holds from 1e\+30 to 1e\+30"),
    (_forward_inputs(t=(-1e30, 0.7)), r"timestep\[0\] \(video\) holds from -1e\+30 to -1e\+30"),
    (_forward_inputs(t=(0.7, -5.0)), r"timestep\[1\] \(audio\) holds from -5 to -5"),
], ids=["video_channels", "audio_channels", "audio_width", "t_minus_1", "t_1e30", "t_minus_1e30", "audio_t_minus_5"])
def test_a_forward_that_does_not_fit_the_model_is_bad_input(pool, model_call, inputs, match):
    pm, ctx, _ = model_call
    refused(lambda: pm.forward(*inputs, ctx), match, fast=True)
    pool.assert_held()
    _forwards_well(model_call)


@pytest.mark.parametrize("conds, match", [
    (_guide_conds(keyframe_idxs=_guide_conds()["keyframe_idxs"].expand(7, -1, -1, -1)),
     r"keyframe_idxs .*batch 7; the latent's batch is 1"),
    (_guide_conds(denoise_mask=-torch.ones(1, 128, 3, 3, 5)), r"denoise_mask is negative in every video token"),
    (_guide_conds(keyframe_idxs=_guide_conds()["keyframe_idxs"] + 10 ** 9), r"keyframe_idxs .*time coordinates from "
                                                                            r"1000000000.*0\.\.24 pixel frames"),
    (_guide_conds(keyframe_idxs=_guide_conds()["keyframe_idxs"] - 10 ** 9), r"keyframe_idxs .*time coordinates from "
                                                                            r"-1000000000"),
    (_guide_conds(keyframe_idxs=_guide_conds()["keyframe_idxs"] - 10 ** 6), r"keyframe_idxs .*from -999992"),
    (_guide_conds(entry={"pixel_mask": torch.ones(1, 3, 1, 96, 160)}), r"guide_attention_entries\[0\] .*pixel_mask "
                                                                        r"is \[1, 3, 1, 96, 160\]"),
    (_guide_conds(entry={"pixel_mask": torch.ones(1, 1, 1, 2, 2)}), r"pixel_mask is \[1, 1, 1, 2, 2\].*at least the "
                                                                     r"guide latent's 3 x 5"),
    (_guide_conds(entry={"latent_shape": [1, 2 ** 40, 2 ** 40]}), r"latent_shape \[1, 1099511627776, 1099511627776\]"
                                                                   r" .*more than its pre_filter_count 15"),
], ids=["keyframe_batch_7", "denoise_mask_all_negative", "keyframes_plus_1e9", "keyframes_minus_1e9",
        "keyframes_minus_1e6", "pixel_mask_channels", "pixel_mask_small", "latent_shape_huge"])
def test_guides_that_do_not_fit_the_latent_are_bad_input(pool, model_call, conds, match):
    pm, ctx, _ = model_call
    x, t = _forward_inputs()
    refused(lambda: pm.forward(x, t, ctx, conds=conds), match, fast=True)
    pool.assert_held()
    good = _guide_conds()
    assert all(bool(torch.isfinite(v).all()) for v in pm.forward(x, t, ctx, conds=good))
    _forwards_well(model_call)


def test_audio_and_reference_audio_tokens_are_bounded_up_front(pool, model_call):
    pm, ctx, _ = model_call
    x, t = _forward_inputs(audio=(1, 8, 32769, 16))
    refused(lambda: pm.forward(x, t, ctx), r"the audio latent has 32769 tokens.*max_tokens=32768", fast=True)
    x, t = _forward_inputs()
    ref = {"tokens": torch.zeros(1, 32762, 128)}
    refused(lambda: pm.forward(x, t, ctx, conds={"ref_audio": ref}),
            r"the audio latent has 32769 tokens \(7 \+ 32762 of the reference audio\).*max_tokens=32768", fast=True)
    pool.assert_held()
    _forwards_well(model_call)


def _submit_forward(pm: PoolModel, client: PoolClient, x, t, ctx):
    """A forward request as PoolModel sends it (context included), submitted without waiting."""
    params = {"model": pm.name, "key": pm.key, "context_id": uuid.uuid4().hex[:16], "frame_rate": 25.0,
              "av_timestep": "scaled", "patches": "none", "kwargs": []}
    tensors = {"x.0": x[0], "x.1": x[1], "t.0": t[0], "t.1": t[1], "context": ctx}
    return client.submit("forward", params, tensors)


@pytest.mark.parametrize("weights", ["replicated", "sharded"])
def test_a_long_forward_stops_on_cancel_between_blocks(pool, model_call, weights):
    """A forward of 16384 audio tokens (within max_tokens: seconds per block on the CPU) is
    cancelled once it runs: it stops at the next transformer block (before the fix it ran to the
    end, ignoring the cancel), on replicated and FSDP-sharded weights alike, and the next call
    gives what it gave before (a sharded model's gathers stayed in step)."""
    pm = model_call[0] if weights == "replicated" else _pool_model(pool, "shard", weights="sharded")
    ctx = model_call[1]
    x, t = _forward_inputs()
    before = pm.forward(x, t, ctx)
    job = _submit_forward(pm, pool.client, *_forward_inputs(video=(1, 128, 1, 2, 2), audio=(1, 8, 16384, 16)), ctx)
    deadline = time.monotonic() + 60
    while (pool.client.status(timeout=10)["current"] or {}).get("id") != job.id:
        assert time.monotonic() < deadline, "the forward never started"
        time.sleep(0.05)
    job.cancel()
    with pytest.raises(JobCancelledError, match=r"cancelled after \d step boundaries"):
        job.wait(timeout=120)
    pool.assert_held()
    assert all(torch.equal(a, b) for a, b in zip(pm.forward(x, t, ctx), before, strict=True))
    if weights == "sharded":
        pool.client.request("unload", {"names": ["shard"]}, timeout=30)


# --------------------------------------------------------------------------- after all of it


def test_the_module_ran_on_one_pool(pool):
    assert pool.restarts == 0  # no request above ended or wedged the pool
    pool.assert_held()
    _samples_well(pool)
    _encodes_well(pool)
