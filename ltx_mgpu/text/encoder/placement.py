"""Where Gemma runs in a multi-process job, and how every rank ends up holding every embedding.

Placements, orthogonal to the weights mode (``bf16`` / ``nf4``, passed through to
:func:`ltx_mgpu.text.encoder.loading.load_gemma_text_tower`):

* ``single``: rank 0 holds Gemma and encodes every prompt.
* ``accelerate``: rank 0 holds Gemma with its decoder layers spread over the given devices
  (Accelerate ``dispatch_model`` hooks move activations between them; execution is sequential,
  so this buys memory, not speed). The split is explicit (``ltx_mgpu.text.encoder.device_map``), not
  ``device_map="balanced"``, which leaves GPUs unused for Gemma 3 12B (``ltx_mgpu.text.encoder.device_map``
  says why): every device gets at least one decoder layer and the bytes are spread in
  proportion to a per-device budget (even by default). With one device (a CPU pool) the whole
  tower sits on it, still behind the same hooks.
* ``batch_parallel``: every rank holds a replica; the prompt list is cut into contiguous
  slices, the remainder going to the first ranks (:func:`split_contiguous`).

Whatever the placement, :func:`replicate_embeddings` leaves every rank holding every prompt's
projected embedding ``[T_i, D]`` (the sequence-parallel denoiser needs them on every rank):
one all-reduce of an ``[N, 3]`` int64 table (tokens, width, dropped tokens; each owner fills
its rows) announces the shapes, then each owner broadcasts its prompts packed in one buffer,
in the wire dtype (:func:`wire_dtype`: the projection's compute dtype, so the trip is exact).
The projected embeddings cross, never the raw hidden states: ``T x D x 2`` bytes per prompt in
bf16 (12.6 MB for a 1024-token LTX-2.3 prompt, D = 6144) instead of ``49 x T x 3840 x 2``
(385 MB).

Nothing here knows the pool: the functions take a rank, a device and ``torch.distributed``
groups (NCCL on GPU, gloo on CPU).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open

from ltx_mgpu.choices import PLACEMENTS, check_choice
from ltx_mgpu.text.cache.keys import weights_mode
from ltx_mgpu.text.config import COMPILE_ACCELERATE, TextEncoderConfig
from ltx_mgpu.text.encoder.configs import read_gemma_config
from ltx_mgpu.text.encoder.device_map import dispatch_text_tower
from ltx_mgpu.text.encoder.loading import load_gemma_text_tower
from ltx_mgpu.text.encoder.local import LocalTextEncoder
from ltx_mgpu.text.encoder.prompt import PromptEncoder, parse_dtype
from ltx_mgpu.text.features import (
    ProjectionFormatError,
    PromptEmbedding,
    detect_projection_version,
    load_projection,
    projection_gemma,
)
from ltx_mgpu.text.gemma.sources import detect_gemma_format

__all__ = [
    "GemmaShape", "ProjectionShape", "ReplicatedEmbeddings", "check_pairing",
    "gather_digests", "holder_ranks", "load_prompt_encoder", "prompt_owners", "read_gemma_shape",
    "read_projection_shape", "replicate_embeddings", "split_contiguous", "wire_dtype",
]


def _check_placement(placement: str) -> None:
    check_choice(placement, PLACEMENTS, "placement")


# --------------------------------------------------------------------------- who does what

def split_contiguous(count: int, parts: int) -> list[range]:
    """``count`` items cut into ``parts`` contiguous slices, the remainder going to the first
    slices: 7 over 4 gives ``[0:2], [2:4], [4:6], [6:7]``; 2 over 4 gives two empty slices last.

    Raises:
        ValueError: ``count < 0`` or ``parts < 1``.
    """
    if count < 0 or parts < 1:
        raise ValueError(f"need count >= 0 and parts >= 1, got count={count}, parts={parts}")
    base, extra = divmod(count, parts)
    out, start = [], 0
    for r in range(parts):
        n = base + (r < extra)
        out.append(range(start, start + n))
        start += n
    return out


def holder_ranks(placement: str, world_size: int) -> list[int]:
    """The ranks that hold Gemma: ``[0]``, or every rank for ``batch_parallel``."""
    _check_placement(placement)
    return list(range(world_size)) if placement == "batch_parallel" else [0]


def prompt_owners(count: int, world_size: int, placement: str) -> list[int]:
    """The rank that encodes each of ``count`` prompts (rank 0 unless ``batch_parallel``)."""
    _check_placement(placement)
    if placement != "batch_parallel":
        return [0] * count
    owners = [0] * count
    for r, sl in enumerate(split_contiguous(count, world_size)):
        for i in sl:
            owners[i] = r
    return owners


# --------------------------------------------------------------------------- pairing (headers only)

@dataclass(frozen=True)
class GemmaShape:
    """What a Gemma 3 source is, read from its config / headers (no weights).

    ``num_hidden_states`` = ``num_hidden_layers + 1`` (49 for 12B); ``hidden_size`` = D (3840)."""

    format: str
    num_hidden_layers: int
    hidden_size: int

    @property
    def num_hidden_states(self) -> int:
        return self.num_hidden_layers + 1


@dataclass(frozen=True)
class ProjectionShape:
    """An LTX-2 text projection read from its safetensors header: version, input width
    (``L x D`` = 188160 for 12B) and output width (3840 for 2.0, 6144 for 2.3)."""

    version: str
    in_features: int
    out_features: int


def read_gemma_shape(path: str | os.PathLike) -> GemmaShape:
    """Layer count and hidden size of a Gemma 3 source without loading weights: ``config.json``
    of a snapshot (through ``transformers.AutoConfig``), the header of a ComfyUI or GGUF file,
    the manifest of an NF4 artifact. The source's files (tokenizer included) are checked too.

    Raises:
        FileNotFoundError, GemmaFormatError (a ValueError): as ``gemma_source_files``.
    """
    fmt = detect_gemma_format(path)
    cfg = read_gemma_config(path)
    return GemmaShape(fmt, int(cfg.num_hidden_layers), int(cfg.hidden_size))


def read_projection_shape(path: str | os.PathLike) -> ProjectionShape:
    """Version and widths of the text projection in an LTX-2 checkpoint or projection file
    (the safetensors header only).

    Raises:
        FileNotFoundError: no such file. ProjectionFormatError (a ValueError): not a
            ``.safetensors`` file, unreadable, or no ``text_embedding_projection`` in it.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"projection source not found: {path}")
    if not path.endswith(".safetensors"):
        raise ProjectionFormatError(f"{path}: expected a .safetensors LTX-2 checkpoint or projection file")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            version, prefix = detect_projection_version(list(f.keys()))
            names = ["aggregate_embed"] if version == "2.0" else ["video_aggregate_embed", "audio_aggregate_embed"]
            shapes = [f.get_slice(f"{prefix}{n}.weight").get_shape() for n in names]
    except ProjectionFormatError as e:
        raise ProjectionFormatError(f"{path}: {e}") from None
    except Exception as e:  # safetensors' own errors for a damaged header
        raise ProjectionFormatError(f"{path}: not a readable .safetensors file ({e})") from None
    if any(len(s) != 2 or s[1] != shapes[0][1] for s in shapes):
        raise ProjectionFormatError(f"{path}: inconsistent text projection shapes {shapes}")
    return ProjectionShape(version, int(shapes[0][1]), int(sum(s[0] for s in shapes)))


def check_pairing(gemma: GemmaShape, projection: ProjectionShape, gemma_path: str = "",
                  projection_path: str = "") -> None:
    """Raise unless the projection takes this Gemma's hidden states: its input width must be
    ``num_hidden_states x hidden_size`` (49 x 3840 for Gemma 3 12B).

    Raises:
        ValueError: they do not fit (the message names both files and the fix).
    """
    want = gemma.num_hidden_states * gemma.hidden_size
    if projection.in_features != want:
        raise ValueError(
            f"the LTX-{projection.version} projection in {projection_path or 'the checkpoint'} takes "
            f"{projection.in_features} input features: it belongs to {projection_gemma(projection.in_features)}, "
            f"but the Gemma at {gemma_path or 'the source'} gives {gemma.num_hidden_states} hidden states of width "
            f"{gemma.hidden_size} (= {want}). Pair the checkpoint with its Gemma: pass the checkpoint (or "
            "projection file) made for this Gemma, or the Gemma the checkpoint was made for (Gemma 3 12B for "
            "LTX-2).")


def load_prompt_encoder(config: TextEncoderConfig, *, device: torch.device | str = "cpu",
                        shard_over: Sequence[torch.device | str] | None = None,
                        max_memory: Mapping[int, int] | None = None) -> tuple[PromptEncoder, dict[str, str] | None]:
    """Load Gemma + the LTX-2 projection of ``config`` for one rank of a placement.

    Without ``shard_over`` (``single``, ``batch_parallel``): exactly
    ``LocalTextEncoder(config, device).build()``, the in-process path. With ``shard_over``
    (``accelerate``): the tower is loaded whole on a staging device, spread by
    :func:`dispatch_text_tower` under ``max_memory`` (bytes per device index), and the projection
    placed on the first device in the compute dtype (float32 on CPU, as
    ``LocalTextEncoder.build``). The staging device is the CPU for bf16
    weights (host memory: the whole model once, 24 GB for 12B; ``load_gemma_text_tower`` places
    a model on one device) and the first shard device for NF4 (7.6 GB for 12B: NF4 is quantized
    on the device type that runs it).

    Returns:
        ``(encoder, device_map or None)``.

    Raises:
        Whatever loading raises (FileNotFoundError, GemmaFormatError, GemmaWeightsError,
        ProjectionFormatError, ValueError for a split that does not fit, for ``compile`` with
        ``shard_over`` or NF4 weights, or for a compiler that fails here,
        torch.OutOfMemoryError).
    """
    if not shard_over:
        return LocalTextEncoder(config, str(device)).build(), None
    if config.compile:
        raise ValueError(COMPILE_ACCELERATE)
    compute = parse_dtype(config.dtype)
    nf4 = weights_mode(config) == "nf4"
    stage = torch.device(shard_over[0]) if nf4 else torch.device("cpu")
    tower = load_gemma_text_tower(config.gemma, device=stage, dtype=compute, weights=config.weights,
                                  host_embeddings=False, layer_dequant=False)
    device_map = dispatch_text_tower(tower, shard_over, max_memory)
    first = torch.device(device_map["embed_tokens"])
    proj = load_projection(config.projection, device=first, dtype=torch.float32 if first.type == "cpu" else compute,
                           num_layers=tower.num_hidden_states)
    return PromptEncoder(tower, proj, config.token_budget, config.truncate), device_map


# --------------------------------------------------------------------------- every rank gets every embedding

def wire_dtype(device_type: str, dtype: str | torch.dtype) -> torch.dtype:
    """The dtype embeddings are broadcast in: the projection's compute dtype (float32 on CPU,
    as ``LocalTextEncoder.build`` places it; the requested dtype on GPU). The encoder's float32
    outputs were upcast from it, so the round trip through it is exact."""
    return torch.float32 if device_type == "cpu" else parse_dtype(dtype)


@dataclass(eq=False)
class ReplicatedEmbeddings:
    """Every prompt's embedding as one rank holds it after :func:`replicate_embeddings`.

    ``tensors[i]``: ``[T_i, D]`` in the wire dtype on the rank's device (views into one
    packed buffer per owner); ``version``: ``"2.0"``/``"2.3"``; ``dropped[i]``: tokens cut
    from prompt ``i``; ``owners[i]``: the rank that encoded it."""

    tensors: list[torch.Tensor]
    version: str
    dropped: list[int]
    owners: list[int]

    @property
    def nbytes(self) -> int:
        return int(sum(t.numel() * t.element_size() for t in self.tensors))

    def prompt_embeddings(self) -> list[PromptEmbedding]:
        """Fresh float32 CPU copies as :class:`PromptEmbedding` s (the encoder's own format)."""
        return [PromptEmbedding(t.detach().to(device="cpu", dtype=torch.float32, copy=True), self.version, d)
                for t, d in zip(self.tensors, self.dropped)]

    def digests(self) -> list[bytes]:
        """SHA-256 (32 bytes) of each embedding's float32 little-endian bytes, as
        :meth:`prompt_embeddings` would return them."""
        return [hashlib.sha256(e.tensor.contiguous().numpy().tobytes()).digest() for e in self.prompt_embeddings()]


def replicate_embeddings(local: Mapping[int, PromptEmbedding], owners: Sequence[int], *, rank: int,
                         world_size: int, device: torch.device, wire: torch.dtype, width: int, version: str,
                         group=None) -> ReplicatedEmbeddings:
    """Give every rank every prompt's embedding, in prompt order. A collective: every rank of
    ``group`` calls it with the same ``owners``, ``wire``, ``width`` and ``version``.

    Args:
        local: this rank's results, prompt index -> embedding ``[T_i, width]`` (exactly the
            indices ``i`` with ``owners[i] == rank``).
        owners: the encoding rank of each prompt; ranks owning nothing still take part.
        device: where this rank's copies land (its GPU, or the CPU on gloo).
        wire: the broadcast dtype (:func:`wire_dtype`).

    Cost: one all-reduce of ``3 N`` int64 (shapes), then one broadcast per rank that owns any
    prompt, of ``sum T_i x width x itemsize(wire)`` bytes. At world size 1 nothing moves: the
    encoder's float32 host tensors are held as they are (converting and copying them to the
    GPU would cost time per prompt for no reader).

    Raises:
        ValueError: ``local`` does not match ``owners``; RuntimeError: a shape disagrees with
            ``width`` (a bug: ranks loaded different projections).
    """
    count = len(owners)
    mine = [i for i in range(count) if owners[i] == rank]
    if sorted(local) != mine:
        raise ValueError(f"rank {rank} holds prompts {sorted(local)} but owns {mine}")
    if world_size == 1:  # nothing to send: keep the encoder's own (host) tensors, moved at use
        return ReplicatedEmbeddings([local[i].tensor for i in range(count)], version,
                                    [local[i].dropped_tokens for i in range(count)], list(owners))
    table = torch.zeros(count, 3, dtype=torch.int64)
    for i in mine:
        e = local[i]
        table[i] = torch.tensor([e.tensor.shape[0], e.tensor.shape[1], e.dropped_tokens])
    table = table.to(device)
    dist.all_reduce(table, group=group)  # each row is written by its owner alone: a sum is a gather
    table = table.cpu()
    if count and not bool((table[:, 1] == width).all()):
        raise RuntimeError(f"embedding widths {table[:, 1].tolist()} differ from the projection's {width}")
    tokens = [int(t) for t in table[:, 0]]
    tensors: list[torch.Tensor | None] = [None] * count
    for src in range(world_size):
        rows = [i for i in range(count) if owners[i] == src]
        total = sum(tokens[i] for i in rows)
        if not total:
            continue
        if src == rank:
            buf = torch.cat([local[i].tensor.to(wire) for i in rows]).to(device)
        else:
            buf = torch.empty(total, width, dtype=wire, device=device)
        dist.broadcast(buf, group=group, group_src=src)
        for i, part in zip(rows, buf.split([tokens[i] for i in rows])):
            tensors[i] = part
    for i in range(count):
        if tensors[i] is None:  # a prompt of zero tokens cannot happen (BOS), but keep shapes honest
            tensors[i] = torch.empty(0, width, dtype=wire, device=device)
    return ReplicatedEmbeddings(tensors, version, [int(d) for d in table[:, 2]], list(owners))


def gather_digests(held: ReplicatedEmbeddings, *, world_size: int, group=None) -> list[list[str]]:
    """Every rank's :meth:`ReplicatedEmbeddings.digests`, all-gathered (a collective on a CPU
    group, e.g. gloo): ``result[r][i]`` is rank ``r``'s SHA-256 hex of prompt ``i``."""
    count = len(held.tensors)
    mine = (torch.frombuffer(bytearray(b"".join(held.digests())), dtype=torch.uint8) if count
            else torch.empty(0, dtype=torch.uint8))
    every = [torch.empty(count * 32, dtype=torch.uint8) for _ in range(world_size)]
    if count:
        dist.all_gather(every, mine, group=group)
    return [[bytes(t[i * 32:(i + 1) * 32].numpy()).hex() for i in range(count)] for t in every]
