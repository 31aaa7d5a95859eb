"""Prompt encoding through the pool, with the embedding cache consulted first (client side).

    config = TextEncoderConfig(gemma="/models/gemma-3-12b-it", projection="/models/ltx-2.3.safetensors",
                               placement="batch_parallel")
    client = PoolClient(resolve_spec("all"))                  # not connected yet
    embeddings, report = encode_prompts(client, config, prompts, cache=EmbeddingCache())

The cache key parts come from the files' contents (``ltx_mgpu.text.cache.keys.cache_key_parts``:
no Gemma load, no pool). Every prompt is looked up first; only the misses go to the pool, so a
fully cached request makes no pool call and never starts a pool. Before the first miss is sent
the pool's resident text encoder is compared with this one by :func:`pool_key` (a digest of the
cache key parts and the placement, reported by ``status``) and loaded when it differs; each
``encode`` request carries the key as ``expect``, so a text encoder swapped by another client in
between is noticed (bad input), reloaded and the request retried once.

``encode_prompts(whole=True)`` encodes every prompt whole, as ComfyUI's LTX-2 text encoder does
(the CLIP of the Gemma Loader node): the same resident encoder, without its token budget's cut.

Text-encoder LoRAs (``patches``: a :class:`~ltx_mgpu.client.lora.TextPatches`, what ``LoraLoader``
gave the CLIP): every ``encode`` / ``generate`` request names the patch set it needs merged
(``"none"`` without one); when the pool holds another it answers ``stale_patches`` and the set is
sent (``sync_text_patches``) and the request retried. The set's content id is part of the cache
key, so a LoRA'd CLIP's embeddings are cached apart from a plain one's.

:func:`generate_text` is ComfyUI's ``CLIP.generate`` + ``CLIP.decode`` on the pool's Gemma
(``ltx_mgpu.pool.generate_jobs``), through the same load and patch remedies.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import time
from typing import Any, Callable, Mapping, Sequence

import torch

from ltx_mgpu.choices import AUTO_DTYPE
from ltx_mgpu.client.errors import BadInputError
from ltx_mgpu.client.lora import TextPatches, sync_text_patches
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.client.spec import resolve_spec
from ltx_mgpu.text.cache.keys import CacheKeyParts, cache_key_parts, resolve_dtype
from ltx_mgpu.text.cache.store import CacheReport, EmbeddingCache, encode_cached
from ltx_mgpu.text.config import TextEncoderConfig
from ltx_mgpu.text.encoder.local import check_not_truncated
from ltx_mgpu.text.features import PromptEmbedding
from ltx_mgpu.text.gemma.sources import detect_gemma_format
from ltx_mgpu.text.generate.image import tokenizer_image
from ltx_mgpu.text.generate.options import GenerateOptions
from ltx_mgpu.wire.messages import MAX_TEXT_TOKENS, NO_PATCHES

__all__ = ["WHOLE_PROMPT_TOKENS", "check_sources", "default_cache", "pool_key", "encode_prompts", "encode_with_pool",
           "ensure_text_encoder", "loaded_key", "embeddings_from_result", "upcast", "generate_text", "has_vision_tower",
           "request_text_encoder", "clip_weight_keys"]

_WIRE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ProgressCallback = Callable[[str, int, int], Any]
#: The most tokens (BOS included) of a prompt encoded whole (``encode_prompts(whole=True)``): the
#: protocol's bound on a prompt's tokens, which the sampler's text conditioning shares.
WHOLE_PROMPT_TOKENS = MAX_TEXT_TOKENS


def check_sources(config: TextEncoderConfig) -> None:
    """Check that ``config.gemma`` is a Gemma 3 source this pack loads, from its file names and
    headers only (no hashing, no pool): a wrong file fails before anything is sent.

    Raises:
        FileNotFoundError, GemmaFormatError: naming the supported formats.
    """
    detect_gemma_format(config.gemma)


def default_cache() -> EmbeddingCache:
    """The embedding cache the nodes and the CLI share by default (in ``default_cache_dir()``)."""
    return EmbeddingCache()


def pool_key(config: TextEncoderConfig, parts: CacheKeyParts | None = None) -> str:
    """The configuration's identity in the pool: SHA-256 hex of the cache key parts (the files'
    contents, weights mode, budget, dtype), the placement, ``truncate``, ``max_memory`` and
    ``compile``. Two clients with the same key share the resident encoder.

    Raises:
        FileNotFoundError, ValueError (GemmaFormatError, ProjectionFormatError): as
        ``cache_key_parts``, when ``parts`` is not given.
    """
    parts = parts or cache_key_parts(config)
    record = {"parts": json.loads(parts.to_json()), "placement": config.placement, "truncate": config.truncate,
              "max_memory": {str(k): v for k, v in (config.max_memory or {}).items()} or None,
              "compile": config.compile}
    return "text:" + hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _on_pool_device(client: PoolClient, config: TextEncoderConfig) -> TextEncoderConfig:
    """``config`` with a compute dtype of ``auto`` resolved for the device of the client's pool,
    read from its spec (CPU ranks or GPUs: no pool is contacted); ``config`` when it names one."""
    return resolve_dtype(config, client.spec.device) if config.dtype == AUTO_DTYPE else config


def loaded_key(client: PoolClient, timeout: float = 30.0) -> str | None:
    """The key of the text encoder resident in the client's pool (``status``), or None."""
    models = client.status(timeout=timeout)["ranks"][0].get("models", {})
    return models.get("text_encoder", {}).get("key")


def ensure_text_encoder(client: PoolClient, config: TextEncoderConfig, key: str | None = None,
                        on_progress: ProgressCallback | None = None, should_cancel: Callable[[], bool] | None = None,
                        timeout: float | None = None) -> dict | None:
    """Load ``config``'s text encoder into the pool unless it is already resident (compared by key);
    a compute dtype of ``auto`` is resolved for the pool's device (its spec: CPU ranks or GPUs).

    Returns:
        The ``load_text_encoder`` result, or None when nothing had to be loaded.

    Raises:
        BadInputError (the pool rejected it; it keeps serving), PoolError and subclasses.
    """
    config = _on_pool_device(client, config)
    key = key or pool_key(config)
    if loaded_key(client) == key:
        return None
    return client.request("load_text_encoder", config.to_params(key), on_progress=on_progress,
                          should_cancel=should_cancel, timeout=timeout)[0]


def request_text_encoder(client: PoolClient, config: TextEncoderConfig, key: str, patches: TextPatches | None,
                         send: Callable[[], Any], on_progress: ProgressCallback | None = None,
                         should_cancel: Callable[[], bool] | None = None, timeout: float | None = None) -> Any:
    """``send()`` (a request naming text encoder ``key`` and the patch set ``patches``), remedied
    and retried when the pool says it holds another encoder (load ``config``) or another patch
    set (send ``patches``).

    Straight to the request: the pool checks ``expect`` and ``patches`` before any work, so the
    resident case (every request after the first) costs no ``status`` round trip (a per-request
    cost: benchmarks/bench_pool_text.py "pool" vs "pool request" measures it).

    Raises:
        BadInputError: the request itself was bad (its encoder and patches are resident), and
            what loading or patching raises; PoolError and subclasses.
    """
    for _ in range(4):  # no encoder or another one, then other patches: each remedied once (twice if swapped)
        try:
            return send()
        except BadInputError as e:
            if e.reason == "stale_patches":
                sync_text_patches(client, key, patches, should_cancel, timeout)
                continue
            if loaded_key(client) == key:
                raise  # ours is resident: the request itself was bad
        ensure_text_encoder(client, config, key, on_progress, should_cancel, timeout)
    return send()


def upcast(name: str, t: torch.Tensor) -> torch.Tensor:
    """A bf16/fp16 ``encode`` result tensor as a fresh float32 copy (exact); anything else as it
    is (never raises: it runs as the ``receive`` of ``encode`` requests on the client's reader
    thread, one pass straight from the shared arena; :func:`embeddings_from_result` checks)."""
    if t.dtype in (torch.bfloat16, torch.float16):
        # torch.empty, not a bytearray: the float32 copy of a large result into torch.empty
        # (page faults taken by torch's threads) is many times faster than into a zero-filled
        # bytearray (host_copy_probe in benchmarks/bench_pool_text.py prints both)
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


def encode_prompts(client: PoolClient, config: TextEncoderConfig, prompts: Sequence[str], *,
                   cache: EmbeddingCache | None = None, batch_size: int = 8,
                   on_progress: ProgressCallback | None = None, should_cancel: Callable[[], bool] | None = None,
                   timeout: float | None = None, keep: bool = True, whole: bool = False,
                   patches: TextPatches | None = None) -> tuple[list[PromptEmbedding], CacheReport]:
    """Embeddings of ``prompts`` (in order), encoding only the cache misses in the pool.

    The misses are sent in requests of ``batch_size`` prompts (``batch_size x ranks`` for
    ``batch_parallel``, one sub-batch per rank), and each request's results are stored in the
    cache as soon as it returns, so an interrupted batch resumes. ``client`` may be
    unconnected (``PoolClient(spec)``): it starts or attaches to the pool on the first miss.

    Args:
        config: the text encoder (its placement included); a compute dtype of ``auto`` is
            resolved for the pool's device from the client's spec (CPU ranks: float32, GPUs:
            bfloat16; ``ltx_mgpu.text.config.resolve_text_dtype``), without contacting the pool.
        cache: ``None`` encodes everything (no cache read or write).
        batch_size: prompts per Gemma forward in the pool.
        on_progress, should_cancel, timeout: as ``Job.wait`` (``timeout`` per request).
        keep: leave the last request's embeddings resident on every rank (``text_embeddings``).
        whole: encode every prompt whole, up to :data:`WHOLE_PROMPT_TOKENS` tokens (BOS
            included), whatever ``config.token_budget`` and ``config.truncate`` say, as ComfyUI's
            LTX-2 text encoder does (the ``encode`` request's ``max_tokens``; the resident encoder
            is not reloaded). Cache entries are keyed with that budget, except that a prompt
            that fits ``config.token_budget`` shares the entry of the budgeted encode (the same
            embedding; ``encode_cached(short=)``).
        patches: the text-encoder LoRAs to encode with (module doc); their content id joins the
            cache key.

    Returns:
        ``(embeddings, CacheReport)``; embeddings are float32 ``[T_i, D]`` on CPU.

    Raises:
        FileNotFoundError, ValueError: a path or format problem found client-side (no pool call).
        BadInputError (with ``whole``: also a prompt over :data:`WHOLE_PROMPT_TOKENS` tokens),
        JobCancelledError, PoolTimeoutError, PoolFatalError, PoolStartError.
    """
    if not isinstance(config, TextEncoderConfig):
        raise ValueError(f"config must be a TextEncoderConfig, got {type(config).__name__}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(whole, bool):
        raise ValueError(f"whole must be True or False, got {whole!r}")
    if patches is not None and not isinstance(patches, TextPatches):
        raise ValueError(f"patches must be a TextPatches or None, got {type(patches).__name__}")
    prompts = list(prompts)
    config = _on_pool_device(client, config)  # before any key: an embedding depends on its dtype
    parts = cache_key_parts(config)
    key = pool_key(config, parts)
    params = {"batch_size": batch_size, "expect": key, "keep": keep,
              "patches": patches.identity if patches is not None else NO_PATCHES}
    if patches is not None:
        parts = dataclasses.replace(parts, lora=patches.identity)
    short = None
    if whole:
        params["max_tokens"] = WHOLE_PROMPT_TOKENS
        short, parts = parts, dataclasses.replace(parts, token_budget=WHOLE_PROMPT_TOKENS)

    def send(chunk: list[str]) -> list[PromptEmbedding]:
        result, tensors = client.request(
            "encode", {"prompts": chunk, **params},
            on_progress=on_progress, should_cancel=should_cancel, timeout=timeout, receive=upcast)
        return embeddings_from_result(result, tensors)

    def encode_remote(chunk: list[str]) -> list[PromptEmbedding]:
        return request_text_encoder(client, config, key, patches, lambda: send(chunk), on_progress, should_cancel,
                                    timeout)

    ranks = client.spec.nproc if config.placement == "batch_parallel" else 1
    request_size = batch_size * ranks
    if cache is not None:
        out = encode_cached(cache, prompts, parts, encode_remote, request_size, short=short)
        if not config.truncate and not whole:
            check_not_truncated(out[0], config.token_budget)
        return out
    t0 = time.perf_counter()
    unique = list(dict.fromkeys(prompts))
    found: dict[str, PromptEmbedding] = {}
    for i in range(0, len(unique), request_size):
        chunk = unique[i:i + request_size]
        found.update(zip(chunk, encode_remote(chunk)))
    return ([found[p] for p in prompts],
            CacheReport(hits=0, misses=len(unique), encoded=len(unique), seconds=time.perf_counter() - t0))


def generate_text(client: PoolClient, config: TextEncoderConfig, text: str, options: GenerateOptions | Mapping, *,
                  patches: TextPatches | None = None, on_progress: ProgressCallback | None = None,
                  should_cancel: Callable[[], bool] | None = None, timeout: float | None = None,
                  image: torch.Tensor | None = None) -> dict:
    """ComfyUI's ``CLIP.generate`` then ``CLIP.decode`` on the pool's Gemma
    (``ltx_mgpu.pool.generate_jobs``): ``text`` is the prompt as ComfyUI's Gemma tokenizer gets it
    (any chat template applied), ``options`` the sampling options (a ``GenerateOptions`` or its
    fields, ComfyUI's ``CLIP.generate`` keywords), ``patches`` the CLIP's LoRAs, ``image`` a
    ComfyUI IMAGE ``[B, H, W, C]`` read by Gemma's vision tower in place of the prompt's first
    ``<image_soft_token>``: resized here as ComfyUI's Gemma tokenizer resizes it
    (``ltx_mgpu.text.generate.image.tokenizer_image``), it travels as raw float32 bytes.
    The text encoder is loaded (or its patches merged) first when the pool holds another.

    Returns:
        The ``generate`` result: ``{"tokens", "text", "stopped", "prompt_tokens", "tokenizer",
        "seconds", "decode_tokens_per_second"}``.

    Raises:
        ValueError: ``text`` is not a string; an option out of range (named; ``GenerateOptions``);
            an image that is not a finite ``[B, H, W, 3+]`` float tensor (``check_image``), before
            any request.
        BadInputError (a Gemma source without a vision tower for an image, naming the fix),
        JobCancelledError, PoolTimeoutError, PoolFatalError, PoolStartError.
    """
    if not isinstance(text, str):
        raise ValueError(f"the prompt must be a string, got {type(text).__name__}")
    tensors = None
    if image is not None:
        tensors = {"image": tokenizer_image(image)}
    if isinstance(options, Mapping):
        options = GenerateOptions(**options)  # ValueError naming a bad option, before any request
    if not isinstance(options, GenerateOptions):
        raise ValueError(f"options must be a GenerateOptions or a mapping of its fields, got {type(options).__name__}")
    config = _on_pool_device(client, config)  # the key names the dtype the pool computes in
    key = pool_key(config)
    params = {"text": text, "expect": key, "patches": patches.identity if patches is not None else NO_PATCHES,
              **options.to_params()}

    def send() -> dict:
        return client.request("generate", params, tensors, on_progress=on_progress, should_cancel=should_cancel,
                              timeout=timeout)[0]

    return request_text_encoder(client, config, key, patches, send, on_progress, should_cancel, timeout)


@functools.lru_cache(maxsize=8)
def _clip_weight_keys(gemma: str, stats: tuple) -> dict[str, tuple[int, ...]]:
    # reads the source's config and builds Gemma on the meta device (transformers): only
    # LoraLoader on the Gemma Loader's CLIP asks for the keys
    from ltx_mgpu.text.encoder.configs import read_gemma_config
    from ltx_mgpu.text.encoder.patches import comfy_vision_keys  # as above
    from ltx_mgpu.text.gemma.lora import comfy_clip_keys, tower_parameter_shapes  # as above
    from ltx_mgpu.text.gemma.vision import find_vision  # as above

    keys = comfy_clip_keys(tower_parameter_shapes(read_gemma_config(gemma)))
    vision = find_vision(gemma)
    if vision is not None:
        keys.update(comfy_vision_keys(vision))
    return keys


@functools.lru_cache(maxsize=8)
def _projection_weight_keys(projection: str, stats: tuple) -> dict[str, tuple[int, ...]]:
    from ltx_mgpu.text.encoder.patches import comfy_projection_keys  # as above (headers only)

    return comfy_projection_keys(projection)


def clip_weight_keys(config: TextEncoderConfig) -> dict[str, tuple[int, ...]]:
    """ComfyUI's state-dict keys of the text encoder's weights -> shape, for ``config``: the Gemma
    text tower's (``gemma3_12b.transformer.model.<name>``), its vision tower's and projector's when
    the Gemma source has them (``gemma3_12b.transformer.vision_model.<name>``,
    ``gemma3_12b.transformer.multi_modal_projector.<name>``) and the LTX-2 text projection's
    (``text_embedding_projection.weight`` for LTX-2.0; ``text_embedding_projection.{video,audio}_
    aggregate_embed.{weight,bias}`` for LTX-2.3: ``ltx_mgpu.text.encoder.patches``), what
    ``comfy.lora.model_lora_keys_clip`` maps a LoRA's text-encoder keys onto. From the sources'
    headers (memoised while their files are unchanged).

    Raises:
        FileNotFoundError, GemmaFormatError: as ``read_gemma_config`` and ``find_vision``. ProjectionFormatError:
            ``config.projection`` has no LTX-2 text projection.
    """
    st = os.stat(config.gemma)
    keys = dict(_clip_weight_keys(config.gemma, (st.st_mtime_ns, st.st_size, st.st_ino)))
    sp = os.stat(config.projection)
    keys.update(_projection_weight_keys(config.projection, (sp.st_mtime_ns, sp.st_size, sp.st_ino)))
    return keys


@functools.lru_cache(maxsize=8)
def _has_vision_tower(gemma: str, stats: tuple) -> bool:
    from ltx_mgpu.text.gemma.vision import find_vision  # deferred: reads headers only, once per file

    return find_vision(gemma) is not None


def has_vision_tower(config: TextEncoderConfig) -> bool:
    """Whether ``config.gemma`` carries Gemma 3's vision tower and projector
    (``ltx_mgpu.text.gemma.vision.find_vision``: headers only; memoised while the source is
    unchanged).

    Raises:
        FileNotFoundError, GemmaFormatError: as ``find_vision``.
    """
    st = os.stat(config.gemma)
    return _has_vision_tower(config.gemma, (st.st_mtime_ns, st.st_size, st.st_ino))


def encode_with_pool(config: TextEncoderConfig, prompts: Sequence[str], *,
                     gpus: str | Sequence[int] | None = None, nproc: int | None = None,
                     runtime_dir: str | os.PathLike | None = None, cache: EmbeddingCache | None = None,
                     batch_size: int = 8, on_progress: ProgressCallback | None = None,
                     startup_timeout: float = 300.0) -> tuple[list[PromptEmbedding], CacheReport, dict]:
    """``encode --pool`` of the CLI: :func:`encode_prompts` through the pool of ``gpus``/``nproc``,
    attached when one runs (a ``pool start --detach`` pool included), else started for this
    call (lifetime ``with-owner``) and released at the end (:meth:`PoolClient.release`: it
    stops, unless a client that attached meanwhile still uses it).

    Returns:
        ``(embeddings, report, pool)`` where ``pool`` says ``{"pid", "started", "stopped",
        "world_size"}`` (``pid`` None when everything was cached and no pool was contacted;
        ``stopped``: a pool started here stopped at the end, rather than running on for
        another client).
    """
    client = PoolClient(resolve_spec(gpus, nproc, "with-owner", runtime_dir), startup_timeout=startup_timeout)
    try:
        embeddings, report = encode_prompts(client, config, prompts, cache=cache, batch_size=batch_size,
                                            on_progress=on_progress)
        started = client.launched
        info = {"pid": client.pid, "started": started, "stopped": False, "world_size": client.pool.get("world_size")}
        if started:
            info["stopped"] = client.release()
        return embeddings, report, info
    finally:
        client.close()
