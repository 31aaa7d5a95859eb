"""The engine registry and the job context every handler receives.

An engine handles one job type on **every** rank (SPMD):
``handler(ctx: JobContext, params: dict, tensors: dict[str, Tensor]) -> (result: dict, tensors: dict)``.
``params`` passed the protocol schema on rank 0 and reach every rank identically; input
tensors arrive on CPU on every rank. Only rank 0's return value is sent to the client (other
ranks may return ``({}, {})``); ``result`` must be JSON-serialisable and the tensors
safetensors-compatible. Result tensors are sent after the handler returns, while the next job
may already run: return fresh tensors, or clone a buffer that a later job modifies in place.

Error contract (after the LTX-2 reference's ``RunnerError``):

* raise :class:`BadInput` for a wrong request, **identically on every rank and before any
  collective** (e.g. while validating ``params``): the client gets ``error{bad_input}`` and the
  pool keeps serving;
* a failure only some ranks can see (a damaged file, out of memory on one GPU) is *agreed*:
  every rank calls ``ctx.agree(error_or_None)`` at the same point, before any data-group
  collective, and all raise the same :class:`BadInput` when any rank failed;
* call ``ctx.check_cancel()`` at step boundaries: it is a collective decision (rank 0 decides,
  the control group broadcasts it) and raises :class:`JobCancelled` on every rank together;
* every exception raised while a handler checks or prepares a request's inputs (parsing,
  files, tokenizers, shapes) is that request's :class:`BadInput`, identical on every rank:
  raised before any collective, or agreed. What a request can make the pool do is bounded up
  front by the protocol's request limits (``ltx_mgpu.wire.messages``: ``MAX_STEPS`` ...), so
  no request holds the pool in work that ignores cancel;
* ``fatal`` is kept for what cannot be unwound: a dead rank, a collective that one rank
  abandoned or that desynced, a timeout, a failure after the ranks started exchanging data.
  The client gets ``error{fatal}`` and the pool exits.

Engines register with :func:`register_engine`; the job types of other packages
(``ENGINE_MODULES``) are imported on first use, so the pool runs without them.
"""

from __future__ import annotations

import gc
import importlib
import json
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ltx_mgpu import wire
from ltx_mgpu.cancellation import Cancelled
from ltx_mgpu.wire import arena
from ltx_mgpu.wire.payload import payload_layout

Handler = Callable[["JobContext", dict, dict], "tuple[dict, dict]"]


class BadInput(Exception):
    """The request is wrong; raise it identically on every rank before any collective.

    ``reason`` (one of ``ltx_mgpu.wire.messages.BAD_INPUT_REASONS``, or None) tells the client
    a remedy it can apply and retry (the error event's ``reason``)."""

    def __init__(self, message: str = "", reason: str | None = None):
        super().__init__(message)
        self.reason = reason


class JobCancelled(Cancelled):
    """Raised by :meth:`JobContext.check_cancel` on every rank together. Not an ``Exception`` (the
    family's base is a ``BaseException``), so a handler's ``except Exception`` does not swallow it."""


_ENGINES: dict[str, Handler] = {}
#: Job types implemented outside ``ltx_mgpu.pool``: the module is imported on first use and is
#: expected to call :func:`register_engine` for them.
ENGINE_MODULES: dict[str, str] = {
    "load_text_encoder": "ltx_mgpu.pool.text_jobs",
    "encode": "ltx_mgpu.pool.text_jobs",
    "text_patches": "ltx_mgpu.pool.text_jobs",
    "generate": "ltx_mgpu.pool.generate_jobs",
    "load_transformer": "ltx_mgpu.pool.denoise_jobs",
    "sample": "ltx_mgpu.pool.denoise_jobs",
    "text_contexts": "ltx_mgpu.pool.model_jobs",
    "forward": "ltx_mgpu.pool.model_jobs",
    "model_patches": "ltx_mgpu.pool.model_jobs",
}


def register_engine(job_type: str, handler: Handler | None = None):
    """Register ``handler`` for ``job_type`` (usable as a decorator).

    Raises:
        ValueError: ``job_type`` is not a job request type in ``ltx_mgpu.wire.REQUESTS``
            (add its schema with ``wire.register_request`` first).
    """
    schema = wire.REQUESTS.get(job_type)
    if schema is None or not schema.job:
        raise ValueError(f"{job_type!r} is not a job request type; register its schema first")

    def deco(fn: Handler) -> Handler:
        _ENGINES[job_type] = fn
        return fn

    return deco(handler) if handler is not None else deco


def resolve_engine(job_type: str) -> Handler:
    """The handler for ``job_type``, importing its module on first use.

    Raises:
        BadInput: no engine for this type in this build (identical on every rank).
    """
    if job_type not in _ENGINES and job_type in ENGINE_MODULES:
        module = ENGINE_MODULES[job_type]
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is None or not module.startswith(e.name):
                raise
    try:
        return _ENGINES[job_type]
    except KeyError:
        raise BadInput(f"job type {job_type!r} is not available in this build of ltx_mgpu "
                       f"(engines: {sorted(_ENGINES)})") from None


# --------------------------------------------------------------------------- resident models

def _describe(obj: Any) -> dict:
    info: dict[str, Any] = {"type": type(obj).__name__}
    if isinstance(obj, torch.nn.Module):
        tensors = list(obj.parameters()) + list(obj.buffers())
        info["bytes"] = int(sum(t.numel() * t.element_size() for t in tensors))
        info["devices"] = sorted({str(t.device) for t in tensors})
    elif isinstance(obj, torch.Tensor):
        info["bytes"] = int(obj.numel() * obj.element_size())
        info["devices"] = [str(obj.device)]
    return info


class ModelStore:
    """Models resident in this rank across jobs (thread-safe: the stats thread reads it).

    ``put(name, obj, info)`` replaces (and frees) any model of that name; ``info`` is a small
    JSON-able description reported by ``status`` (default: type, bytes of parameters and
    buffers, devices)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[str, Any] = {}
        self._info: dict[str, dict] = {}

    def put(self, name: str, obj: Any, info: dict | None = None) -> Any:
        self.pop(name)
        with self._lock:
            self._items[name] = obj
            self._info[name] = {**_describe(obj), **(info or {})}
        return obj

    def get(self, name: str, default: Any = None) -> Any:
        with self._lock:
            return self._items.get(name, default)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._items

    def pop(self, name: str, default: Any = None) -> Any:
        with self._lock:
            self._info.pop(name, None)
            return self._items.pop(name, default)

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._items)

    def describe(self) -> dict[str, dict]:
        with self._lock:
            return {k: dict(v) for k, v in self._info.items()}

    def clear(self) -> list[str]:
        """Drop every model; returns their names."""
        with self._lock:
            names = sorted(self._items)
            self._items.clear()
            self._info.clear()
        return names


def free_memory(device: torch.device) -> None:
    """``gc.collect()`` and, on CUDA, ``torch.cuda.empty_cache()`` (returns cached blocks)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- job context

@dataclass(eq=False)
class JobContext:
    """What a handler gets on each rank.

    ``device`` is this rank's device (``cuda:<local_rank>`` or ``cpu``); ``control_group`` is a
    CPU gloo group for decisions and small messages; ``data_group`` carries tensors (NCCL on
    GPU, gloo on CPU); ``models`` is the rank's resident :class:`ModelStore`. ``progress`` and
    ``log`` speak through rank 0 (no-ops elsewhere)."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    control_group: Any
    data_group: Any
    models: ModelStore
    job_id: str
    job_type: str
    _emit_progress: Callable[[str, int, int], None] | None = None
    _emit_log: Callable[[str, str], None] | None = None
    _cancel_requested: Callable[[], bool] | None = None
    _reserve_result: Callable[[int], torch.Tensor | None] | None = None
    checks: int = field(default=0)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def progress(self, phase: str, step: int, total: int) -> None:
        """Report progress (``step`` of ``total`` in ``phase``) to the client. Call it on every
        rank (it is not a collective); only rank 0's call is sent."""
        if self._emit_progress is not None:
            self._emit_progress(phase, step, total)

    def log(self, message: str, level: str = "info") -> None:
        """A log line: to the client from rank 0, to ``pool.log`` from every rank (a request's
        text, e.g. a path of non-UTF-8 bytes, is written with backslash escapes where it is not
        UTF-8, never failing the job)."""
        line = f"[rank {self.rank}] {level}: {message}".encode("utf-8", "backslashreplace").decode("utf-8")
        print(line, flush=True)
        if self._emit_log is not None:
            self._emit_log(level, message)

    def result_buffers(self, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> dict[str, torch.Tensor] | None:
        """CPU tensors, one per ``(name, dtype, shape)`` of ``specs``, that lie where this job's
        result payload will be handed to the client in shared memory (``ltx_mgpu.wire.sender``,
        ``ArenaSender.reserve``): a handler that fills them and returns them under those names
        (and no other tensors) has its result sent without a copy, unless the memory was
        taken back meanwhile (the connection closed or idled out, or a newer reservation):
        then it is copied as any result; the tensors stay valid either way. ``None`` when it is
        not on offer (not rank 0, a client without the ``shm_own`` feature, a small result, no
        spare memory ready, or a layout that would misalign a dtype): then return ordinary
        tensors. Not a collective.

        The tensors are shared with the client once sent (it may write them): do not keep or
        read them past the job.
        """
        if self._reserve_result is None or not specs:
            return None
        _, spans = payload_layout(specs)
        if any((arena.HEADER_BYTES + spans[name][0]) % dtype.itemsize for name, dtype, _ in specs):
            return None
        region = self._reserve_result(max(end for _, end in spans.values()))
        if region is None:
            return None
        return {name: region[slice(*spans[name])].view(dtype).view(tuple(shape)) for name, dtype, shape in specs}

    def cancel_requested(self) -> bool:
        """Whether the client asked to cancel this job, as rank 0 knows it (False on the other
        ranks). Not a collective: for work one rank does alone (a generation on rank 0) to stop
        early; every rank then meets at :meth:`check_cancel`, which decides for all."""
        return self.is_main and self._cancel_requested is not None and bool(self._cancel_requested())

    def check_cancel(self) -> None:
        """Collective step boundary: rank 0 decides continue/cancel and broadcasts it over the
        control group; raises :class:`JobCancelled` on every rank together. Every rank must
        call it the same number of times."""
        cancel = self._cancel_requested is not None and self._cancel_requested()
        if self.world_size > 1:  # one rank decides alone
            flag = torch.tensor([int(cancel)], dtype=torch.int32)
            dist.broadcast(flag, src=0, group=self.control_group)
            cancel = bool(flag[0])
        self.checks += 1
        if cancel:
            raise JobCancelled(f"job {self.job_id} cancelled")

    def agree(self, error: BaseException | str | None, what: str | None = None) -> None:
        """Collective over the control group: turn a failure some ranks saw into the same
        :class:`BadInput` on every rank, so the pool keeps serving. Every rank must call it at
        the same point of the job, and before any data-group collective that a failed rank
        would skip.

        ``error`` is this rank's outcome: ``None`` (it went well), a message for the client,
        or the exception that failed it (its traceback goes to ``pool.log``; the message is
        :func:`failure_message` of it and ``what``). An exception keeps the frames of its
        traceback alive: where they hold memory (out of memory in a forward), format the
        message inside the ``except`` block with :func:`failure_message` and pass the string.

        Raises:
            BadInput: on every rank, when any rank failed: the first failing rank's message,
                followed by `` (on rank r)`` or `` (on rank r and k more)`` in a pool of
                several ranks.
        """
        if isinstance(error, BaseException):
            error = failure_message(error, what)
        elif error is not None and not isinstance(error, str):
            raise TypeError(f"agree() takes an exception, a message or None, not {type(error).__name__}")
        if self.world_size == 1:  # nothing to agree on: no collective (per-request time of a one-GPU pool)
            if error is not None:
                raise BadInput(error)
            return
        flags = [torch.zeros(1, dtype=torch.int32) for _ in range(self.world_size)]
        mine = torch.tensor([int(error is not None)], dtype=torch.int32)
        dist.all_gather(flags, mine, group=self.control_group)
        failed = [r for r, f in enumerate(flags) if int(f)]
        if not failed:
            return
        message = broadcast_json(error if self.rank == failed[0] else None, failed[0], self.control_group, self.rank)
        if self.world_size > 1:
            more = f" and {len(failed) - 1} more" if len(failed) > 1 else ""
            message = f"{message} (on rank {failed[0]}{more})"
        raise BadInput(message)

    def broadcast_json(self, value: Any = None, src: int = 0) -> Any:
        """Send a JSON-able ``value`` from rank ``src`` to every rank over the control group
        (e.g. a cache decision made once); returns it on every rank."""
        return broadcast_json(value if self.rank == src else None, src, self.control_group, self.rank)


def failure_message(error: BaseException, what: str | None = None) -> str:
    """``"<what> failed: <text> (<Type>)"`` (``"<text> (<Type>)"`` without ``what``; ``<Type>`` alone
    for an exception without text) for a client, after printing the exception's traceback to stderr
    (the pool's ``pool.log``). The words come first, the exception's class last: ComfyUI shows the
    message in its error pop-up."""
    traceback.print_exception(error)
    words = str(error).strip()
    text = f"{words} ({type(error).__name__})" if words else type(error).__name__
    return f"{what} failed: {text}" if what else text


def broadcast_json(value: Any, src: int, group: Any, rank: int) -> Any:
    """JSON broadcast over a CPU group (length, then UTF-8 bytes); never pickles. For small
    decisions and metadata; tensors belong on the data group."""
    raw = json.dumps(value).encode() if rank == src else b""
    n = torch.tensor([len(raw)], dtype=torch.int64)
    dist.broadcast(n, src=src, group=group)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if rank == src else torch.empty(int(n), dtype=torch.uint8)
    if int(n):
        dist.broadcast(buf, src=src, group=group)
    return json.loads(bytes(buf.numpy()).decode()) if int(n) else None


# --------------------------------------------------------------------------- built-in engines

#: The longest ``selftest`` step sleep (seconds): a cancel waits for the sleep to end.
MAX_STEP_SECONDS = 60.0


@register_engine("selftest")
def selftest(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """Communication self-test and test driver.

    First rank 0 broadcasts a JSON message over the control group (every rank checks it). Then
    each of ``steps`` steps: check cancel, all-reduce a ``numel``-element float32 tensor filled
    with ``rank + 1`` over the data group (expected sum ``W(W+1)/2``), sleep ``step_seconds``,
    report progress. Options: ``result_bytes`` adds a uint8 tensor ``blob`` of that size to the
    result (kept resident as ``selftest.blob`` for repeated benchmarks); ``echo`` returns the
    input tensors; ``fail_rank``/``fail_step`` raise a RuntimeError on that rank at that step
    (a deliberate fatal fault). Returns ``{"world_size", "steps_done", "allreduce_ok",
    "control_ok", "expected", "allreduce_seconds", "device"}`` and tensors ``allreduce`` (last step) and the
    optional ``blob`` / echoed tensors.

    Raises:
        BadInput: ``steps < 0``, ``step_seconds`` outside 0..MAX_STEP_SECONDS, ``numel`` outside 1..2**28 or
            ``result_bytes`` outside 0..2**34.
    """
    steps, step_seconds = params["steps"], float(params.get("step_seconds", 0.0))
    numel, result_bytes = params.get("numel", 1024), params.get("result_bytes", 0)
    if steps < 0:
        raise BadInput(f"selftest steps must be >= 0, got {steps}")
    if not 0 <= step_seconds <= MAX_STEP_SECONDS:  # a sleep ignores cancel: bounded
        raise BadInput(f"selftest step_seconds must be in 0..{MAX_STEP_SECONDS:g}, got {step_seconds}")
    if not 1 <= numel <= 1 << 28:
        raise BadInput(f"selftest numel must be in 1..2**28, got {numel}")
    if not 0 <= result_bytes <= 1 << 34:
        raise BadInput(f"selftest result_bytes must be in 0..2**34, got {result_bytes}")
    fail_rank, fail_step = params.get("fail_rank"), params.get("fail_step", 0)
    message = {"job": ctx.job_id, "world_size": ctx.world_size}
    if ctx.broadcast_json(message if ctx.is_main else None) != message:
        raise RuntimeError(f"selftest: the control-group broadcast reached rank {ctx.rank} corrupted")
    expected = ctx.world_size * (ctx.world_size + 1) / 2
    ok, timings, x = True, [], None
    for step in range(steps):
        ctx.check_cancel()
        if fail_rank == ctx.rank and fail_step == step:
            raise RuntimeError(f"selftest: injected failure on rank {ctx.rank} at step {step}")
        t0 = time.perf_counter()
        x = torch.full((numel,), float(ctx.rank + 1), dtype=torch.float32, device=ctx.device)
        dist.all_reduce(x, group=ctx.data_group)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        timings.append(time.perf_counter() - t0)
        ok = ok and bool((x == expected).all())
        if step_seconds:
            time.sleep(step_seconds)
        ctx.progress("selftest", step + 1, steps)
    out: dict[str, torch.Tensor] = {}
    if x is not None:
        out["allreduce"] = x.cpu()
    if result_bytes and ctx.is_main:
        blob = ctx.models.get("selftest.blob")
        if blob is None or blob.numel() != result_bytes:
            pattern = torch.arange(251, dtype=torch.uint8)  # byte i is i % 251
            blob = ctx.models.put("selftest.blob", pattern.repeat(-(-result_bytes // 251))[:result_bytes].clone())
        out["blob"] = blob
    if params.get("echo"):
        out.update(tensors)
    return {"world_size": ctx.world_size, "steps_done": len(timings), "allreduce_ok": ok, "control_ok": True,
            "expected": expected,
            "allreduce_seconds": timings[-64:], "device": str(ctx.device)}, out


@register_engine("unload")
def unload(ctx: JobContext, params: dict, tensors: dict) -> tuple[dict, dict]:
    """Free resident models (``names``, or all when ``None``), run ``gc`` and empty the CUDA
    cache. Returns ``{"unloaded": [...], "resident": [...]}`` (rank 0's view)."""
    names = params.get("names")
    freed = (ctx.models.clear() if names is None
             else [n for n in names if ctx.models.pop(n, _MISSING) is not _MISSING])
    free_memory(ctx.device)
    return {"unloaded": freed, "resident": ctx.models.names()}, {}


_MISSING = object()
