"""Pool nodes: configure the sidecar GPU pool, show its state, free its models.

* **Pool** (``LTXMGPU_Pool``) -> ``LTXMGPU_POOL``: which GPUs, the pool's lifetime, and whether
  ComfyUI unloads its own models before a pool job on its GPU. Nothing starts here (the first
  request that needs the pool starts it or attaches to a running one).
* **Pool Status** (``LTXMGPU_PoolStatus``) -> STRING: ranks, memory, models, current job.
* **Free Pool Memory** (``LTXMGPU_Free``) -> STRING: the pool releases its models (or stops).
"""

from __future__ import annotations

from ltx_mgpu.choices import LIFETIMES

from ._comfy import io
from ._runtime import CATEGORY, PoolHandle, PoolType


class LTXMGPUPool(io.ComfyNode):
    """The ``LTXMGPU_POOL`` handle (see :class:`nodes._runtime.PoolHandle`)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LTXMGPU_Pool",
            display_name="LTX-2 Multi-GPU Pool",
            category=CATEGORY,
            description=("A pool of worker processes, one per GPU, that runs Gemma 3 and the LTX-2 transformer "
                         "outside ComfyUI's process. It starts on first use or attaches to a running one."),
            inputs=[
                io.String.Input("gpus", default="all", tooltip=(
                    "GPUs of the pool: 'all' (every GPU ComfyUI can see), a list like '0,1,2,3' (as ComfyUI "
                    "numbers them), or 'cpu' (CPU ranks; for tests). One worker process per GPU.")),
                io.Int.Input("cpu_ranks", default=1, min=1, max=64, tooltip=(
                    "Number of CPU worker processes when the pool runs on the CPU ('cpu', or no GPU visible). "
                    "Ignored on GPUs.")),
                io.Combo.Input("lifetime", options=list(LIFETIMES), default="with-owner", tooltip=(
                    "with-owner: the pool stops when ComfyUI exits. detached: it keeps running (and keeps its "
                    "models loaded) for the next ComfyUI session; stop it with the Free node or "
                    "`python -m ltx_mgpu pool stop`. Applies when the pool starts.")),
                io.Boolean.Input("free_comfy_vram", default=True, tooltip=(
                    "When the pool uses the GPU ComfyUI computes on, ask ComfyUI to unload its own models "
                    "before each pool job, so both do not compete for that GPU's memory.")),
            ],
            outputs=[PoolType.Output("pool", tooltip=(
                "The pool handle; connect it to the Gemma Loader and the Model Loader."))],
        )

    @classmethod
    def execute(cls, gpus: str, cpu_ranks: int, lifetime: str, free_comfy_vram: bool) -> io.NodeOutput:
        return io.NodeOutput(PoolHandle(gpus=gpus, cpu_ranks=int(cpu_ranks), lifetime=lifetime,
                                        free_comfy_vram=bool(free_comfy_vram)))


def _status_text(handle: PoolHandle) -> str:
    from ltx_mgpu.client.discovery import format_status, pool_status

    status = pool_status(handle.spec)
    if status is None:
        return f"pool on {handle.describe()}: not running (it starts with the first job that needs it)"
    return format_status(status)


def _pool_input(what: str):
    return PoolType.Input("pool", tooltip=f"The pool to {what} (from the Pool node).")


class LTXMGPUPoolStatus(io.ComfyNode):
    """Text report of the pool (does not start one)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LTXMGPU_PoolStatus",
            display_name="LTX-2 Multi-GPU Pool Status",
            category=CATEGORY,
            description="Shows the pool's ranks, memory per rank, resident models and jobs. Never starts a pool.",
            inputs=[_pool_input("report on")],
            outputs=[io.String.Output("status", tooltip=(
                "Ranks, devices, memory per rank, resident models, current and queued jobs."))],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return float("nan")  # the pool changes outside the graph: run every time

    @classmethod
    def execute(cls, pool: PoolHandle) -> io.NodeOutput:
        text = _status_text(pool)
        return io.NodeOutput(text, ui={"text": [text]})


class LTXMGPUFree(io.ComfyNode):
    """Make the pool release its models (or stop it)."""

    @classmethod
    def define_schema(cls):
        return io.Schema(
            node_id="LTXMGPU_Free",
            display_name="LTX-2 Multi-GPU Free Pool Memory",
            category=CATEGORY,
            description=("Unloads Gemma and the LTX-2 transformer from every GPU of the pool (ComfyUI's own "
                         "'free memory' does not reach the pool's processes), or stops the pool."),
            inputs=[
                _pool_input("free"),
                io.Boolean.Input("stop_pool", default=False, tooltip=(
                    "Stop the pool's processes instead of only unloading their models (the next job starts "
                    "a fresh pool).")),
            ],
            outputs=[io.String.Output("report", tooltip="What was freed.")],
            is_output_node=True,
        )

    @classmethod
    def fingerprint_inputs(cls, **kwargs):
        return float("nan")

    @classmethod
    def execute(cls, pool: PoolHandle, stop_pool: bool) -> io.NodeOutput:
        from ltx_mgpu.client.discovery import free_pool

        out = free_pool(pool.spec, shutdown=bool(stop_pool))
        if not out["running"]:
            text = f"pool on {pool.describe()}: not running, nothing to free"
        elif out["stopped"]:
            text = f"pool on {pool.describe()}: stopped"
        else:
            text = (f"pool on {pool.describe()}: unloaded "
                    f"{', '.join(out['unloaded']) or 'nothing (no model was loaded)'}")
        return io.NodeOutput(text, ui={"text": [text]})


NODES = (LTXMGPUPool, LTXMGPUPoolStatus, LTXMGPUFree)
