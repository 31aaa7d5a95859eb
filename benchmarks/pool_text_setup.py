"""The inputs of ``bench_pool_text.py`` (see its docstring): the 12B-shaped random snapshot and
projection written to disk, prompts of an exact token count, and the host-copy probe."""

from __future__ import annotations

import gc
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import torch

from benchmarks.bench_text import GEMMA_12B
from benchmarks.timing import sync as _sync
from ltx_mgpu.text.gemma.sources import gemma3_text_config


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# --------------------------------------------------------------------------- inputs

def host_copy_probe(numel: int = 8 * 1024 * 6144, rounds: int = 5) -> dict[str, float]:
    """Median ms of a bf16 -> float32 copy of ``numel`` values (default: an 8x1024-token LTX-2.3
    result) on this host into: fresh ``torch.empty`` memory (what the client's upcast uses),
    a fresh zero-filled ``bytearray`` (what it used before) and reused memory (no page faults)."""
    src = torch.randn(numel).bfloat16()
    reused = torch.empty(numel)
    targets = {"torch.empty": lambda: torch.empty(numel),
               "bytearray": lambda: torch.frombuffer(bytearray(4 * numel), dtype=torch.float32),
               "reused": lambda: reused}
    out = {}
    for name, make in targets.items():
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            make().copy_(src)
            times.append((time.perf_counter() - t0) * 1e3)
        out[name] = statistics.median(times)
    return out


def exact_prompts(tokenizer, count: int, tokens: int, seed: int = 0) -> list[str]:
    """``count`` distinct prompts of random lowercase words that tokenize to exactly ``tokens``
    ids, BOS included (so nothing is truncated and every row is ``tokens`` long).

    Raises:
        RuntimeError: no exact fit was found (a tokenizer without single-letter pieces).
    """
    letters = "abcdefghijklmnopqrstuvwxyz"
    rng = random.Random(seed)

    def n(text: str) -> int:
        return len(tokenizer(text)["input_ids"])

    prompts = []
    for _ in range(count):
        words: list[str] = []
        while n(" ".join(words)) < tokens:
            words.append("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))))
        words.pop()
        text = " ".join(words)
        while n(text) < tokens:
            have = n(text)
            options = [text + sep + c for sep in (" ", "") for c in letters]
            fits = [t for t in options if have < n(t) <= tokens]
            if not fits:
                raise RuntimeError(f"cannot reach exactly {tokens} tokens from {have}")
            text = min(fits, key=lambda t: (tokens - n(t), t))
        prompts.append(text)
    if len(set(prompts)) != count:
        raise RuntimeError("prompts are not distinct")
    return prompts


def write_projection(path: Path, layers: int, hidden: int, device: torch.device) -> tuple[float, int]:
    """A random LTX-2.3 text projection file (bf16 ``text_embedding_projection.*``:
    ``(layers + 1) x hidden`` -> 4096 video + 2048 audio; drawn on ``device``); returns
    (seconds to write it, bytes)."""
    from safetensors.torch import save_file

    gen = torch.Generator(device=device).manual_seed(1)
    width = (layers + 1) * hidden

    def weight(rows: int) -> torch.Tensor:
        return (torch.randn(rows, width, generator=gen, device=device) * 0.002).bfloat16().cpu()

    prefix = "text_embedding_projection."
    tensors = {
        prefix + "video_aggregate_embed.weight": weight(4096),
        prefix + "video_aggregate_embed.bias": torch.zeros(4096, dtype=torch.bfloat16),
        prefix + "audio_aggregate_embed.weight": weight(2048),
        prefix + "audio_aggregate_embed.bias": torch.zeros(2048, dtype=torch.bfloat16),
    }
    tmp = path.with_name(path.name + ".tmp")
    t0 = time.perf_counter()
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return time.perf_counter() - t0, path.stat().st_size


def build_snapshot(out: Path, layers: int, device: torch.device, tokenizer_dir: Path) -> dict:
    """Build the 12B-shaped random Gemma 3 text model on ``device`` and save it with
    ``save_pretrained`` (bf16 safetensors, 5 GB shards) plus the tokenizer files of
    ``tokenizer_dir``. Returns ``{"build_seconds", "save_seconds", "bytes"}``."""
    from transformers import Gemma3TextModel

    torch.manual_seed(0)
    config = gemma3_text_config(**dict(GEMMA_12B, layers=layers))
    t0 = time.perf_counter()
    with torch.device(device):
        model = Gemma3TextModel._from_config(config, dtype=torch.bfloat16).eval()
    _sync(device)
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(str(partial), max_shard_size="5GB")
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, partial / name)
    os.replace(partial, out)
    save_s = time.perf_counter() - t0
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"build_seconds": build_s, "save_seconds": save_s, "bytes": _dir_bytes(out)}


def snapshot_bytes(layers: int = GEMMA_12B["layers"]) -> int:
    """Weight bytes of a ``layers``-layer bf16 snapshot of the 12B shape (2 x the parameter
    count: embedding, per layer q/k/v/o + gate/up/down + 4 norms + q/k norms, final norm);
    23.5 GB at 48 layers."""
    d, f, q, kv = GEMMA_12B["hidden"], GEMMA_12B["intermediate"], GEMMA_12B["heads"], GEMMA_12B["kv_heads"]
    hd = GEMMA_12B["head_dim"]
    layer = d * q * hd * 2 + d * kv * hd * 2 + 3 * d * f + 4 * d + 2 * hd
    return 2 * (GEMMA_12B["vocab"] * d + layers * layer + d)


def start_pool(device: torch.device, work: Path):
    """A 1-rank pool on ``device`` (``cuda:i`` or the CPU) whose runtime directory is in ``work``."""
    from ltx_mgpu.client.pool_client import PoolClient

    if device.type == "cuda":
        return PoolClient.connect(gpus=[device.index], runtime_dir=work / "runtime")
    return PoolClient.connect(gpus="cpu", nproc=1, runtime_dir=work / "runtime")


def finish(client, args, work: Path, log) -> None:
    """Shut the pool down (when one started) and remove ``work``, unless ``--keep`` asked to keep
    a random snapshot built there (then ``log`` says how to reuse it)."""
    if client is not None:
        client.shutdown()
        client.close()
    if args.keep and args.source == "random" and not args.snapshot:
        log(f"kept {work} (reuse: --snapshot {work}/gemma3-12b-shaped-{args.layers}l-random "
            f"--projection {work}/ltx23-projection-random.safetensors)")
    else:
        shutil.rmtree(work, ignore_errors=True)
