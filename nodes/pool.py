"""Pool nodes: configure the sidecar GPU pool, show its state, free its models.

* **Pool** (``LTXMGPU_Pool``) -> ``LTXMGPU_POOL``: which GPUs, the pool's lifetime, and whether
  ComfyUI unloads its own models before a pool job on its GPU. Nothing starts here (the first
  request that needs the pool starts it or attaches to a running one).
* **Pool Status** (``LTXMGPU_PoolStatus``) -> STRING: ranks, memory, models, current job.
* **Free Pool Memory** (``LTXMGPU_Free``) -> STRING: the pool releases its models (or stops).
"""

from __future__ import annotations

from ltx_mgpu.choices import LIFETIMES

from ._runtime import CATEGORY, POOL, PoolHandle


class LTXMGPUPool:
    """The ``LTXMGPU_POOL`` handle (see :class:`nodes._runtime.PoolHandle`)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "gpus": ("STRING", {"default": "all", "tooltip": (
                    "GPUs of the pool: 'all' (every GPU ComfyUI can see), a list like '0,1,2,3' (as ComfyUI "
                    "numbers them), or 'cpu' (CPU ranks; for tests). One worker process per GPU.")}),
                "cpu_ranks": ("INT", {"default": 1, "min": 1, "max": 64, "tooltip": (
                    "Number of CPU worker processes when the pool runs on the CPU ('cpu', or no GPU visible). "
                    "Ignored on GPUs.")}),
                "lifetime": (list(LIFETIMES), {"default": "with-owner", "tooltip": (
                    "with-owner: the pool stops when ComfyUI exits. detached: it keeps running (and keeps its "
                    "models loaded) for the next ComfyUI session; stop it with the Free node or "
                    "`python -m ltx_mgpu pool stop`. Applies when the pool starts.")}),
                "free_comfy_vram": ("BOOLEAN", {"default": True, "tooltip": (
                    "When the pool uses the GPU ComfyUI computes on, ask ComfyUI to unload its own models "
                    "before each pool job, so both do not compete for that GPU's memory.")}),
            },
        }

    RETURN_TYPES = (POOL,)
    RETURN_NAMES = ("pool",)
    OUTPUT_TOOLTIPS = ("The pool handle; connect it to the Gemma Loader and the Model Loader.",)
    FUNCTION = "make"
    CATEGORY = CATEGORY
    DESCRIPTION = ("A pool of worker processes, one per GPU, that runs Gemma 3 and the LTX-2 transformer "
                   "outside ComfyUI's process. It starts on first use or attaches to a running one.")

    def make(self, gpus: str, cpu_ranks: int, lifetime: str, free_comfy_vram: bool):
        return (PoolHandle(gpus=gpus, cpu_ranks=int(cpu_ranks), lifetime=lifetime,
                           free_comfy_vram=bool(free_comfy_vram)),)


def _status_text(handle: PoolHandle) -> str:
    from ltx_mgpu.client.discovery import format_status, pool_status

    status = pool_status(handle.spec)
    if status is None:
        return f"pool on {handle.describe()}: not running (it starts with the first job that needs it)"
    return format_status(status)


class LTXMGPUPoolStatus:
    """Text report of the pool (does not start one)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"pool": (POOL, {"tooltip": "The pool to report on (from the Pool node)."})}}

    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("status",)
    OUTPUT_TOOLTIPS = ("Ranks, devices, memory per rank, resident models, current and queued jobs.",)
    FUNCTION = "report"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True
    DESCRIPTION = "Shows the pool's ranks, memory per rank, resident models and jobs. Never starts a pool."

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")  # the pool changes outside the graph: run every time

    def report(self, pool: PoolHandle):
        text = _status_text(pool)
        return {"ui": {"text": [text]}, "result": (text,)}


class LTXMGPUFree:
    """Make the pool release its models (or stop it)."""

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "pool": (POOL, {"tooltip": "The pool to free (from the Pool node)."}),
                "stop_pool": ("BOOLEAN", {"default": False, "tooltip": (
                    "Stop the pool's processes instead of only unloading their models (the next job starts "
                    "a fresh pool).")}),
            },
        }

    RETURN_TYPES = ("STRING",)
    RETURN_NAMES = ("report",)
    OUTPUT_TOOLTIPS = ("What was freed.",)
    FUNCTION = "free"
    CATEGORY = CATEGORY
    OUTPUT_NODE = True
    DESCRIPTION = ("Unloads Gemma and the LTX-2 transformer from every GPU of the pool (ComfyUI's own "
                   "'free memory' does not reach the pool's processes), or stops the pool.")

    @classmethod
    def IS_CHANGED(cls, **kwargs):
        return float("nan")

    def free(self, pool: PoolHandle, stop_pool: bool):
        from ltx_mgpu.client.discovery import free_pool

        out = free_pool(pool.spec, shutdown=bool(stop_pool))
        if not out["running"]:
            text = f"pool on {pool.describe()}: not running, nothing to free"
        elif out["stopped"]:
            text = f"pool on {pool.describe()}: stopped"
        else:
            text = (f"pool on {pool.describe()}: unloaded "
                    f"{', '.join(out['unloaded']) or 'nothing (no model was loaded)'}")
        return {"ui": {"text": [text]}, "result": (text,)}


NODE_CLASS_MAPPINGS = {
    "LTXMGPU_Pool": LTXMGPUPool,
    "LTXMGPU_PoolStatus": LTXMGPUPoolStatus,
    "LTXMGPU_Free": LTXMGPUFree,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "LTXMGPU_Pool": "LTX-2 Multi-GPU Pool",
    "LTXMGPU_PoolStatus": "LTX-2 Multi-GPU Pool Status",
    "LTXMGPU_Free": "LTX-2 Multi-GPU Free Pool Memory",
}
