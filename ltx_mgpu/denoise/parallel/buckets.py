"""Video token buckets: the token count a model call is padded up to when the transformer blocks
are compiled, so that nearby sizes share one compiled graph (:class:`TokenBuckets`, one frozen
rule; :func:`token_buckets` reads it from ``$LTX_MGPU_TOKEN_BUCKETS``).

Why: compiled blocks (``dtype: fp8``, :func:`ltx_mgpu.denoise.fp8.compile_blocks`) have one static
graph per set of input shapes, and a first call at a token count never seen compiles before it
runs (:mod:`ltx_mgpu.denoise.compiling`). Padding the video tokens up to a bucket makes every
count of a bucket run the bucket's graph. Eager blocks have no graphs: they are never bucketed.

The rule: the count ``t`` is rounded up to a multiple of a step that grows with it, a power of two,
``step(t) = max(min_step, 2 ** floor(log2 t) / per_octave)``: each doubling of the token count
(an *octave*, ``2^k`` to ``2^(k+1)``) holds ``per_octave`` buckets of equal width, so the padding is
below ``t / per_octave`` (the step is at most ``t / per_octave``) wherever the step is above
``min_step``, and below ``min_step`` tokens where it is not (small calls, which cost little).
The default, 32 per octave, pads less than 1/32 of the tokens (3.1 %; on average over the counts
of a bucket, half a step: 0.8 to 1.6 %), and 32 graphs cover a doubling of sizes. Why not
coarser: the padding is paid at every step of every call, the compile it saves once per machine
and bucket (the compile cache keeps it), so the default keeps the padding to a few percent;
coarser buckets (16 or 8: under 6.3 % or 12.5 %) let more sizes share a graph (one more latent
frame adds ``1/F`` of a latent of ``F`` frames: 1/16 at 121 frames). Every bucket is a multiple
of ``min_step``, 64 by default: of every power-of-two GPU count up to 64 (so sequence
parallelism's own padding to a multiple of the world size adds nothing; :meth:`TokenBuckets.padded`
combines both) and of the 64-row tiles of the attention and GEMM kernels. LTX-2's token counts
(latent frames x height x width, each latent row 32 pixels) fall on the grid often (6,144 =
16 x 16 x 24 is a bucket of its own); counts just below one share it (6,080 = 16 x 20 x 19 pads
64 tokens to 6,144).

Padding is exact (:mod:`ltx_mgpu.denoise.parallel.ulysses`: the padded keys are left out of
every attention, the padded rows dropped), and its cost is about the padded fraction of the
call's compute; ``benchmarks/bench_compile.py`` measures it and the first call at a nearby size.
Without torch (it imports only :mod:`ltx_mgpu.settings`).
"""

from __future__ import annotations

import dataclasses

from ltx_mgpu import settings

__all__ = ["DEFAULT_PER_OCTAVE", "MIN_STEP", "TokenBuckets", "token_buckets"]

#: Buckets per doubling of the token count by default (``$LTX_MGPU_TOKEN_BUCKETS``' default, 32).
DEFAULT_PER_OCTAVE = settings.TOKEN_BUCKETS.default
#: The smallest step between two buckets (a power of two).
MIN_STEP = 64


def _power_of_two(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and n & (n - 1) == 0


@dataclasses.dataclass(frozen=True)
class TokenBuckets:
    """The bucket rule (module doc): ``per_octave`` buckets per doubling of the token count,
    steps of at least ``min_step`` tokens.

    Raises:
        ValueError: ``per_octave`` or ``min_step`` is not a power of two (1, 2, 4, ...).
    """

    per_octave: int = DEFAULT_PER_OCTAVE
    min_step: int = MIN_STEP

    def __post_init__(self) -> None:
        for name in ("per_octave", "min_step"):
            value = getattr(self, name)
            if not _power_of_two(value):
                raise ValueError(f"token buckets: {name} must be a power of two (1, 2, 4, ... 32, 64), "
                                 f"got {value!r}")

    def step(self, tokens: int) -> int:
        """The width of the bucket holding ``tokens`` (>= 1): a power of two.

        Raises:
            ValueError: ``tokens`` below 1.
        """
        if tokens < 1:
            raise ValueError(f"a bucket needs at least 1 token, got {tokens}")
        return max(self.min_step, (1 << (int(tokens).bit_length() - 1)) // self.per_octave)

    def bucket(self, tokens: int) -> int:
        """``tokens`` rounded up to its bucket: the smallest multiple of :meth:`step` not below it."""
        step = self.step(tokens)
        return -(-int(tokens) // step) * step

    def padded(self, tokens: int, world: int = 1, limit: int | None = None) -> int:
        """The token count a call of ``tokens`` video tokens runs at on ``world`` ranks: its
        :meth:`bucket` rounded up to a multiple of ``world`` (sequence parallelism splits the
        tokens evenly), never above ``limit`` (the model's token budget, ``max_tokens``) rounded
        up the same way, and never below ``tokens`` rounded up to a multiple of ``world`` (what
        sequence parallelism pads to without buckets). So a count near the budget pads to the
        budget, and one padding serves both.

        Raises:
            ValueError: ``tokens`` or ``world`` below 1.
        """
        if world < 1:
            raise ValueError(f"a world size is at least 1, got {world}")

        def even(n: int) -> int:
            return -(-n // world) * world

        padded = even(self.bucket(tokens))
        if limit is not None:
            padded = min(padded, even(limit))
        return max(padded, even(tokens))


def token_buckets(environ=None) -> TokenBuckets | None:
    """The rule ``$LTX_MGPU_TOKEN_BUCKETS`` sets (buckets per doubling of the token count; default
    :data:`DEFAULT_PER_OCTAVE`), or None when it is 0 (off: one compiled graph per token count).

    Raises:
        ValueError: a value that is not 0 or a power of two (the message names the variable).
    """
    per_octave = settings.TOKEN_BUCKETS.get(environ)
    if per_octave == 0:
        return None
    if not _power_of_two(per_octave):
        raise ValueError(f"${settings.TOKEN_BUCKETS.name}={per_octave}: give a power of two (buckets per doubling "
                         f"of the video token count: 8, 16, 32, 64...) or 0 to turn buckets off")
    return TokenBuckets(per_octave)
