"""Prompt encoding through the pool, with the embedding cache consulted first (client side).

    encoder = PoolTextEncoder(gemma="/models/gemma-3-12b-it", projection="/models/ltx-2.3.safetensors",
                              placement="batch_parallel")
    client = PoolClient(launch.resolve_spec("all"))           # not connected yet
    embeddings, report = encode_prompts(client, encoder, prompts, cache=EmbeddingCache())

The cache key parts come from the files' contents (``TextEncoderSpec.cache_key_parts``: no
Gemma load, no pool). Every prompt is looked up first; only the misses go to the pool, so a
fully cached request makes no pool call and never starts a pool. Before the first miss is sent
the pool's resident text encoder is compared with this one by :meth:`PoolTextEncoder.key` (a
digest of the cache key parts and the placement, reported by ``status``) and loaded when it
differs; each ``encode`` request carries the key as ``expect``, so a text encoder swapped by
another client in between is noticed (bad input), reloaded and the request retried once.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from ltx_mgpu.text.cache import CacheKeyParts, CacheReport, EmbeddingCache, encode_cached
from ltx_mgpu.text.encoder import parse_dtype
from ltx_mgpu.text.spec import TextEncoderSpec
from ltx_mgpu.text.features import TOKEN_BUDGET, PromptEmbedding
from ltx_mgpu.text.placement import COMPILE_ACCELERATE, PLACEMENTS

if TYPE_CHECKING:  # pragma: no cover
    from ltx_mgpu.client import PoolClient

__all__ = ["PoolTextEncoder", "encode_prompts", "encode_with_pool", "ensure_text_encoder", "loaded_key",
           "embeddings_from_result", "upcast"]

_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ProgressCallback = Callable[[str, int, int], Any]


@dataclass(frozen=True)
class PoolTextEncoder:
    """A text encoder to run in the pool: the fields of :class:`TextEncoderSpec` that change the
    embeddings, plus where Gemma runs.

    Attributes:
        gemma, projection: paths (made absolute here; the pool's working directory differs).
        weights: ``"bf16"`` or ``"nf4"``.
        placement: ``"single"`` | ``"accelerate"`` | ``"batch_parallel"``.
        dtype: compute dtype name (``"bfloat16"``; ``"float32"`` for reference runs).
        token_budget, truncate, compile: as :class:`TextEncoderSpec` (``compile``: placements
            ``single`` and ``batch_parallel``).
        max_memory: accelerate only: bytes (or ``"70GiB"``) per pool GPU index.

    Raises:
        ValueError: an unknown weights mode, placement or dtype; ``compile`` with NF4 weights or
            placement ``accelerate``.
    """

    gemma: str
    projection: str
    weights: str = "bf16"
    placement: str = "single"
    dtype: str = "bfloat16"
    token_budget: int = TOKEN_BUDGET
    truncate: bool = True
    max_memory: Mapping[int, int | str] | None = None
    compile: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "gemma", os.path.abspath(os.fspath(self.gemma)))
        object.__setattr__(self, "projection", os.path.abspath(os.fspath(self.projection)))
        object.__setattr__(self, "dtype", str(parse_dtype(self.dtype)).removeprefix("torch."))
        if self.weights not in ("bf16", "nf4"):
            raise ValueError(f"weights must be 'bf16' or 'nf4', got {self.weights!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {list(PLACEMENTS)}, got {self.placement!r}")
        if self.compile and self.placement == "accelerate":
            raise ValueError(COMPILE_ACCELERATE)
        self.text_spec()  # the spec's own checks (compile with NF4 weights), before any pool call

    @classmethod
    def from_spec(cls, spec: TextEncoderSpec, placement: str = "single",
                  max_memory: Mapping[int, int | str] | None = None) -> PoolTextEncoder:
        """The pool twin of an in-process spec (its ``device`` is the pool's business)."""
        return cls(spec.gemma, spec.projection, spec.weights, placement, spec.dtype, spec.token_budget, spec.truncate,
                   max_memory, spec.compile)

    def text_spec(self) -> TextEncoderSpec:
        """The in-process spec with the same cache key (never built here)."""
        return TextEncoderSpec(self.gemma, self.projection, self.weights, "cpu", self.dtype, self.token_budget,
                               self.truncate, self.compile)

    def cache_key_parts(self) -> CacheKeyParts:
        """The cache key parts, from file contents (memoised digests; no Gemma load).

        Raises:
            FileNotFoundError, ValueError (GemmaFormatError, ProjectionFormatError).
        """
        return self.text_spec().cache_key_parts()

    def key(self, parts: CacheKeyParts | None = None) -> str:
        """The configuration's identity in the pool: SHA-256 hex of the cache key parts (the
        files' contents, weights mode, budget, dtype), the placement, ``truncate`` and
        ``max_memory``. Two clients with the same key share the resident encoder."""
        parts = parts or self.cache_key_parts()
        record = {"parts": json.loads(parts.to_json()), "placement": self.placement, "truncate": self.truncate,
                  "max_memory": {str(k): v for k, v in (self.max_memory or {}).items()} or None,
                  "compile": self.compile}
        return "text:" + hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()

    def load_params(self, key: str) -> dict:
        """The ``load_text_encoder`` request parameters."""
        params = {"source": self.gemma, "projection": self.projection, "weights": self.weights,
                  "placement": self.placement, "dtype": self.dtype, "token_budget": self.token_budget,
                  "truncate": self.truncate, "key": key}
        if self.compile:  # only when on: a pool of a release without the field still takes the others
            params["compile"] = True
        if self.max_memory is not None:
            params["max_memory"] = {str(k): v for k, v in self.max_memory.items()}
        return params


def loaded_key(client: PoolClient, timeout: float = 30.0) -> str | None:
    """The key of the text encoder resident in the client's pool (``status``), or None."""
    models = client.status(timeout=timeout)["ranks"][0].get("models", {})
    return models.get("text_encoder", {}).get("key")


def ensure_text_encoder(client: PoolClient, encoder: PoolTextEncoder, key: str | None = None,
                        on_progress: ProgressCallback | None = None, should_cancel: Callable[[], bool] | None = None,
                        timeout: float | None = None) -> dict | None:
    """Load ``encoder`` into the pool unless it is already resident (compared by key).

    Returns:
        The ``load_text_encoder`` result, or None when nothing had to be loaded.

    Raises:
        BadInputError (the pool rejected it; it keeps serving), PoolError and subclasses.
    """
    key = key or encoder.key()
    if loaded_key(client) == key:
        return None
    return client.request("load_text_encoder", encoder.load_params(key), on_progress=on_progress,
                          should_cancel=should_cancel, timeout=timeout)[0]


def upcast(name: str, t: torch.Tensor) -> torch.Tensor:
    """A bf16/fp16 ``encode`` result tensor as a fresh float32 copy (exact); anything else as it
    is (never raises: it runs as the ``receive`` of ``encode`` requests on the client's reader
    thread, one pass straight from the shared arena; :func:`embeddings_from_result` checks)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        # torch.empty, not a bytearray: on the H200 host the float32 copy of an 8x1024-token
        # result (100 MB of bf16) took 10.5 ms into torch.empty (page faults taken by torch's
        # threads) and 104-113 ms into a zero-filled bytearray (host_copy_probe in
        # benchmarks/bench_pool_text.py prints both)
        return torch.empty(t.shape, dtype=torch.float32).copy_(t)
    return t


def embeddings_from_result(result: Mapping[str, Any], tensors: Mapping[str, Any]) -> list[PromptEmbedding]:
    """The :class:`PromptEmbedding` s of an ``encode`` result, in prompt order: float32 CPU
    ``[T_i, D]``, upcast (exactly) from the wire dtype when the pool sent bf16 (:func:`upcast`).

    Raises:
        ValueError: a ``prompt_<i>`` tensor is missing or not ``[T, D]`` in a wire dtype
            (float32, bf16, fp16): a damaged answer.
    """
    out = []
    for i in range(result["count"]):
        t = tensors.get(f"prompt_{i}")
        if t is None:
            raise ValueError(f"the pool's encode result lacks tensor prompt_{i} of {result['count']}")
        if not isinstance(t, torch.Tensor) or t.dtype not in _WIRE_DTYPES or t.dim() != 2:
            raise ValueError(f"the pool's encode result prompt_{i} is {getattr(t, 'dtype', type(t).__name__)} "
                             f"{tuple(getattr(t, 'shape', ()))}: want [T, D] float32, bf16 or fp16")
        out.append(PromptEmbedding(upcast(f"prompt_{i}", t), result["version"], int(result["dropped_tokens"][i])))
    return out


def encode_prompts(client: PoolClient, encoder: PoolTextEncoder | TextEncoderSpec, prompts: Sequence[str], *,
                   cache: EmbeddingCache | None = None, batch_size: int = 8,
                   on_progress: ProgressCallback | None = None, should_cancel: Callable[[], bool] | None = None,
                   timeout: float | None = None, keep: bool = True) -> tuple[list[PromptEmbedding], CacheReport]:
    """Embeddings of ``prompts`` (in order), encoding only the cache misses in the pool.

    The misses are sent in requests of ``batch_size`` prompts (``batch_size x ranks`` for
    ``batch_parallel``, one sub-batch per rank), and each request's results are stored in the
    cache as soon as it returns, so an interrupted batch resumes. ``client`` may be
    unconnected (``PoolClient(spec)``): it starts or attaches to the pool on the first miss.

    Args:
        encoder: the configuration; a :class:`TextEncoderSpec` means placement ``single``.
        cache: ``None`` encodes everything (no cache read or write).
        batch_size: prompts per Gemma forward in the pool.
        on_progress, should_cancel, timeout: as ``Job.wait`` (``timeout`` per request).
        keep: leave the last request's embeddings resident on every rank (``text_embeddings``).

    Returns:
        ``(embeddings, CacheReport)``; embeddings are float32 ``[T_i, D]`` on CPU.

    Raises:
        FileNotFoundError, ValueError: a path or format problem found client-side (no pool call).
        BadInputError, JobCancelledError, PoolTimeoutError, PoolFatalError, PoolStartError.
    """
    from ltx_mgpu.client import BadInputError

    if isinstance(encoder, TextEncoderSpec):
        encoder = PoolTextEncoder.from_spec(encoder)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    prompts = list(prompts)
    parts = encoder.cache_key_parts()
    key = encoder.key(parts)

    def send(chunk: list[str]) -> list[PromptEmbedding]:
        result, tensors = client.request(
            "encode", {"prompts": chunk, "batch_size": batch_size, "expect": key, "keep": keep},
            on_progress=on_progress, should_cancel=should_cancel, timeout=timeout, receive=upcast)
        return embeddings_from_result(result, tensors)

    def encode_remote(chunk: list[str]) -> list[PromptEmbedding]:
        # Straight to ``encode``: the pool checks ``expect`` before any work and rejects a request
        # for an encoder it does not hold, so the resident case (every request after the first)
        # costs no ``status`` round trip (which took 4-16 ms per request on the H200,
        # benchmarks/bench_pool_text.py "pool" vs "pool request").
        # None loaded yet, or another client swapped the pool's text encoder in between: load
        # ours and retry (twice at most: the first load itself may be swapped out before our
        # request runs).
        for _ in range(2):
            try:
                return send(chunk)
            except BadInputError:
                if loaded_key(client) == key:
                    raise  # ours is resident: the request itself was bad
            ensure_text_encoder(client, encoder, key, on_progress, should_cancel, timeout)
        return send(chunk)

    ranks = client.spec.nproc if encoder.placement == "batch_parallel" else 1
    request_size = batch_size * ranks
    if cache is not None:
        out = encode_cached(cache, prompts, parts, encode_remote, request_size)
        if not encoder.truncate:
            from ltx_mgpu.text.spec import check_not_truncated

            check_not_truncated(out[0], encoder.token_budget)
        return out
    t0 = time.perf_counter()
    unique = list(dict.fromkeys(prompts))
    found: dict[str, PromptEmbedding] = {}
    for i in range(0, len(unique), request_size):
        chunk = unique[i:i + request_size]
        found.update(zip(chunk, encode_remote(chunk)))
    return ([found[p] for p in prompts],
            CacheReport(hits=0, misses=len(unique), encoded=len(unique), seconds=time.perf_counter() - t0))


def encode_with_pool(spec: TextEncoderSpec, prompts: Sequence[str], *, placement: str = "single",
                     gpus: str | Sequence[int] | None = None, nproc: int | None = None,
                     runtime_dir: str | os.PathLike | None = None, cache: EmbeddingCache | None = None,
                     batch_size: int = 8, max_memory: Mapping[int, int | str] | None = None,
                     on_progress: ProgressCallback | None = None,
                     startup_timeout: float = 300.0) -> tuple[list[PromptEmbedding], CacheReport, dict]:
    """``encode --pool`` of the CLI: :func:`encode_prompts` through the pool of ``gpus``/``nproc``,
    attached when one runs (a ``pool start --detach`` pool included), else started for this
    call (lifetime ``with-owner``) and shut down at the end.

    Returns:
        ``(embeddings, report, pool)`` where ``pool`` says ``{"pid", "started", "world_size"}``
        (``pid`` None when everything was cached and no pool was contacted).
    """
    from ltx_mgpu.client import PoolClient
    from ltx_mgpu.pool import launch

    encoder = PoolTextEncoder.from_spec(spec, placement, max_memory)
    client = PoolClient(launch.resolve_spec(gpus, nproc, "with-owner", runtime_dir), startup_timeout=startup_timeout)
    try:
        embeddings, report = encode_prompts(client, encoder, prompts, cache=cache, batch_size=batch_size,
                                            on_progress=on_progress)
        started = client.launched
        info = {"pid": client.pid, "started": started, "world_size": client.pool.get("world_size")}
        if started:
            client.shutdown()
        return embeddings, report, info
    finally:
        client.close()

