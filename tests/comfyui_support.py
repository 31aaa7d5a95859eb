"""Plumbing of ``test_comfyui_real.py`` (and ``docs/screenshots.py``): ComfyUI started headless on
the CPU with this pack and the tiny models, prompts run through ``/prompt`` + ``/ws``, and headless
Chromium driven over the DevTools protocol. Nothing here is a test; see that module's docstring.

``$COMFYUI_DIR`` is the ComfyUI checkout, ``$COMFYUI_PYTHON`` (default: this interpreter) runs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
COMFYUI_PYTHON = os.environ.get("COMFYUI_PYTHON", sys.executable)
#: The model names the shipped workflows use -> the tiny stand-in linked under that name (None: the
#: tiny LTX-2.3 checkpoint with its audio VAE; "gemma": the tiny Gemma 3 as a ComfyUI single file), so
#: the UI files load in the frontend without "missing model" marks.
WORKFLOW_MODELS = {"checkpoints/ltx-2-19b-dev.safetensors": None, "text_encoders/gemma_3_12B_it.safetensors": "gemma"}

# Built in ComfyUI's interpreter with ComfyUI's own AudioVAE, so its loader accepts the result.
AUDIO_VAE_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
from comfy.cli_args import args
args.cpu = True
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from comfy.ldm.lightricks.vae.audio_vae import AudioVAE
src, dst = sys.argv[1], sys.argv[2]
ddconfig = {"double_z": True, "mel_bins": 64, "z_channels": 8, "resolution": 256, "downsample_time": False,
            "in_channels": 2, "out_ch": 2, "ch": 8, "ch_mult": [1, 2, 4], "num_res_blocks": 1, "attn_resolutions": [],
            "dropout": 0.0, "mid_block_add_attention": False, "norm_type": "pixel", "causality_axis": "height"}
audio = {"model": {"params": {"ddconfig": ddconfig, "sampling_rate": 16000}},
         "preprocessing": {"stft": {"filter_length": 1024, "hop_length": 160}}}
# upsample 10 x 16 = the mel hop (160), as in the real model: 16 kHz out (AAC refuses odd rates such as 400 Hz)
vocoder = {"resblock_kernel_sizes": [3], "upsample_rates": [10, 16], "upsample_kernel_sizes": [20, 32],
           "resblock_dilation_sizes": [[1, 3, 5]], "upsample_initial_channel": 16, "stereo": True, "resblock": "1"}
with safe_open(src, "pt") as f:
    meta = dict(f.metadata())
config = json.loads(meta["config"])
config.update(audio_vae=audio, vocoder=vocoder)
meta["config"] = json.dumps(config)
vae = AudioVAE({"config": meta["config"]})
g = torch.Generator().manual_seed(0)
sd = load_file(src)
for key, value in vae.state_dict().items():
    t = (0.02 * torch.randn(value.shape, generator=g)) if value.is_floating_point() else value.clone()
    if key.endswith("std-of-means"):
        t = torch.ones(value.shape)
    if key.endswith("mean-of-means"):
        t = torch.zeros(value.shape)
    sd[("audio_vae." + key[len("autoencoder."):]) if key.startswith("autoencoder.") else key] = t.contiguous()
save_file(sd, dst, metadata=meta)
"""


#: The skip mark of every test that needs a real ComfyUI (``COMFYUI_DIR``).
NEEDS_COMFYUI_REASON = ("COMFYUI_DIR does not point at a ComfyUI checkout (docs/testing.md: 'Testing against a real "
                        "ComfyUI'); these tests need ComfyUI's own environment with torchaudio")


def has_comfyui() -> bool:
    """Whether ``COMFYUI_DIR`` points at a ComfyUI checkout."""
    return bool(COMFYUI_DIR) and (Path(COMFYUI_DIR) / "main.py").is_file()


def load_pack_in_process() -> dict:
    """In a process that has imported ComfyUI: load this repository as ComfyUI loads a custom node
    and return its nodes by id (``benchmarks.comfy_pack.load_pack``)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from benchmarks.comfy_pack import load_pack

    return load_pack()


def collect_warnings() -> list[str]:
    """A list that receives the message of every WARNING (or worse) logged from now on."""
    import logging

    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    logging.getLogger().addHandler(Collect(level=logging.WARNING))
    return messages


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read().decode()
            return r.status, (json.loads(raw) if raw[:1] in "{[" else raw)
    except urllib.error.HTTPError as e:
        raw = e.read().decode()
        return e.code, (json.loads(raw) if raw[:1] in "{[" else raw)


class Server:
    def __init__(self, url: str, output: Path, log: Path, proc: subprocess.Popen):
        self.url, self.output, self.log, self.proc = url, output, log, proc

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]


@contextlib.contextmanager
def comfyui_server(tiny_gemma_dir: Path, tiny_ltx_23: Path, port: int | None = None,
                   links: dict[str, Path] | None = None, prepare=None):
    """Start ComfyUI headless on the CPU with this pack and the tiny models; yields a :class:`Server`
    once ``/object_info`` lists our nodes, and stops it (and its pools) on exit. ``links`` adds
    model files as symbolic links, ``{"checkpoints/name.safetensors": target}`` (None: the tiny
    checkpoint with its audio VAE); ``docs/screenshots.py`` gives the tiny models the names the
    shipped workflows use. ``prepare(root)`` runs on the ComfyUI root (``models/``, ``user/``...)
    before ComfyUI starts.

    Raises:
        AssertionError: the tiny audio VAE could not be built, or ComfyUI exited / did not list our
            nodes within 10 minutes (the message holds the log's tail).
    """
    root = Path(tempfile.mkdtemp(prefix="ltxm-comfy-"))
    runtime = Path(tempfile.mkdtemp(prefix="lmc-", dir="/tmp"))
    models = root / "models"
    for folder in ("checkpoints", "text_encoders", "diffusion_models", "loras"):
        (models / folder).mkdir(parents=True)
    ckpt = models / "checkpoints" / "tiny-ltx-2.3.safetensors"
    built = subprocess.run([COMFYUI_PYTHON, "-c", AUDIO_VAE_SCRIPT, str(tiny_ltx_23), str(ckpt), COMFYUI_DIR],
                           capture_output=True, text=True, timeout=600, cwd=COMFYUI_DIR)
    assert built.returncode == 0, f"building the tiny audio VAE in ComfyUI failed:\n{built.stderr[-4000:]}"
    (models / "text_encoders" / "tiny-gemma").symlink_to(tiny_gemma_dir, target_is_directory=True)
    for name, target in (links or {}).items():
        (models / name).symlink_to(ckpt if target is None else Path(target))
    (root / "custom_nodes").mkdir()
    (root / "custom_nodes" / "ltx-mgpu").symlink_to(REPO, target_is_directory=True)
    extra = root / "extra_model_paths.yaml"
    extra.write_text(f"ltx_mgpu_test:\n  base_path: {root}\n  checkpoints: models/checkpoints\n"
                     "  text_encoders: models/text_encoders\n  diffusion_models: models/diffusion_models\n"
                     "  loras: models/loras\n  custom_nodes: custom_nodes\n")
    output = root / "output"
    for d in (output, root / "input", root / "temp", root / "user"):
        d.mkdir()
    if prepare is not None:
        prepare(root)
    port = port or free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LTX_MGPU_RUNTIME_DIR": str(runtime),
           "LTX_MGPU_CACHE_DIR": str(root / "cache"), "PYTHONUNBUFFERED": "1"}
    log = root / "comfyui.log"
    cmd = [COMFYUI_PYTHON, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
           "--extra-model-paths-config", str(extra), "--output-directory", str(output),
           "--input-directory", str(root / "input"), "--temp-directory", str(root / "temp"),
           "--user-directory", str(root / "user"), "--database-url", f"sqlite:///{root / 'comfyui.db'}",
           "--disable-auto-launch"]  # nothing (settings, database) is written into the ComfyUI checkout
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=COMFYUI_DIR, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", output, log, proc)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"ComfyUI exited:\n{srv.log_tail()}"
            with contextlib.suppress(OSError):
                if http(f"{srv.url}/object_info/LTXMGPU_Pool", timeout=5)[0] == 200:
                    break
            assert time.monotonic() < deadline, f"ComfyUI did not list our nodes:\n{srv.log_tail()}"
            time.sleep(1.0)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        sys.path.insert(0, str(Path(__file__).parent))
        from pool_support import cleanup

        cleanup(runtime)
        shutil.rmtree(root, ignore_errors=True)


def workflow_model_links(tiny_gemma_comfy_file: Path) -> dict[str, Path | None]:
    """``links`` for :func:`comfyui_server` giving the tiny models the shipped workflows' model names."""
    return {name: (tiny_gemma_comfy_file if target == "gemma" else target) for name, target in WORKFLOW_MODELS.items()}


def tiny_prompt(api: dict, steps: int = 2) -> dict:
    """An API workflow pointed at the tiny models, on 2 CPU ranks, with a 64x64, 9-frame latent."""
    api = json.loads(json.dumps(api))
    ckpt = "tiny-ltx-2.3.safetensors"
    for node in api.values():
        t, inp = node["class_type"], node["inputs"]
        if t == "LTXMGPU_Pool":
            inp.update(gpus="cpu", cpu_ranks=2)
        elif t == "LTXMGPU_GemmaLoader":
            inp.update(gemma="tiny-gemma/", projection=f"checkpoints/{ckpt}")
        elif t in ("CheckpointLoaderSimple", "LTXVAudioVAELoader", "LTXMGPU_ModelLoader"):
            inp["ckpt_name"] = ckpt
        elif t == "EmptyLTXVLatentVideo":
            inp.update(width=64, height=64, length=9)
        elif t == "LTXVEmptyLatentAudio":
            inp["frames_number"] = 9
        elif t in ("LTXMGPU_SPSampler", "LTXVScheduler"):
            inp["steps"] = steps
        elif t == "SaveVideo":
            inp["filename_prefix"] = f"ltx_mgpu_test/{uuid.uuid4().hex[:8]}"
    return api


async def run_prompt(srv: Server, prompt: dict, on_message=None, timeout: float = 900.0) -> tuple[str, list[dict]]:
    """POST ``prompt``, follow ``/ws`` until it finishes; ``(prompt_id, messages)``."""
    import aiohttp

    client_id = uuid.uuid4().hex
    messages: list[dict] = []
    async with aiohttp.ClientSession() as session, \
            session.ws_connect(f"{srv.url.replace('http', 'ws')}/ws?clientId={client_id}") as ws:
        async with session.post(f"{srv.url}/prompt", json={"prompt": prompt, "client_id": client_id}) as r:
            answer = await r.json()
            assert r.status == 200, f"/prompt refused the workflow: {json.dumps(answer)[:3000]}"
        prompt_id = answer["prompt_id"]
        deadline = time.monotonic() + timeout
        while True:
            msg = await ws.receive(timeout=max(1.0, deadline - time.monotonic()))
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue  # binary previews
            data = json.loads(msg.data)
            messages.append(data)
            if on_message is not None:
                await on_message(session, data)
            d = data.get("data", {})
            if d.get("prompt_id") not in (None, prompt_id):
                continue
            if data["type"] in ("execution_error", "execution_interrupted"):
                return prompt_id, messages
            if data["type"] == "executing" and d.get("node") is None and d.get("prompt_id") == prompt_id:
                return prompt_id, messages


def api_workflow(name: str) -> dict:
    return json.loads((REPO / "workflows" / "api" / f"{name}.api.json").read_text())


@contextlib.contextmanager
def chromium_page(url: str, chromium: str, size: tuple[int, int] = (1400, 900)):
    """Headless Chromium showing ``url``; yields that page's DevTools websocket URL, and stops it.

    Raises:
        AssertionError: Chromium opened no debuggable page within 60 s.
    """
    port = free_port()
    profile = tempfile.mkdtemp(prefix="ltxm-chromium-")
    proc = subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                             "--no-first-run", "--disable-background-networking", "--disable-component-update",
                             "--disable-sync",
                             "--hide-scrollbars", f"--user-data-dir={profile}", f"--remote-debugging-port={port}",
                             f"--window-size={size[0]},{size[1]}", url],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        target = None
        while target is None:
            assert time.monotonic() < deadline, "Chromium did not open a debuggable page"
            with contextlib.suppress(OSError, ValueError):
                pages = http(f"http://127.0.0.1:{port}/json/list")[1]
                target = next((p for p in pages if p.get("type") == "page" and url in p.get("url", "")), None)
            time.sleep(0.5)
        yield target["webSocketDebuggerUrl"]
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        shutil.rmtree(profile, ignore_errors=True)


async def cdp_page(ws_url: str, script_steps, timeout: float = 120.0):
    """Drive one page over the Chrome DevTools Protocol: each step gets ``evaluate(expr)`` (the
    expression's value, promises awaited; AssertionError when it throws); returns (results, errors
    the page logged)."""
    import aiohttp

    errors, results, counter = [], [], [0]
    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        async def call(method, params=None):
            counter[0] += 1
            mid = counter[0]
            await ws.send_json({"id": mid, "method": method, "params": params or {}})
            while True:
                msg = json.loads((await ws.receive(timeout=timeout)).data)
                if msg.get("method") == "Runtime.consoleAPICalled" and msg["params"]["type"] == "error":
                    errors.append(" ".join(str(a.get("value", a.get("description", "")))
                                           for a in msg["params"]["args"]))
                elif msg.get("method") == "Runtime.exceptionThrown":
                    errors.append(json.dumps(msg["params"]["exceptionDetails"])[:2000])
                elif msg.get("method") == "Log.entryAdded" and msg["params"]["entry"]["level"] == "error":
                    errors.append(f"{msg['params']['entry'].get('text')} {msg['params']['entry'].get('url', '')}")
                elif msg.get("id") == mid:
                    return msg.get("result", {})

        async def evaluate(expr):
            out = await call("Runtime.evaluate", {"expression": expr, "awaitPromise": True, "returnByValue": True})
            if "exceptionDetails" in out:
                raise AssertionError(f"page script failed: {json.dumps(out['exceptionDetails'])[:2000]}")
            return out.get("result", {}).get("value")

        await call("Runtime.enable")
        await call("Log.enable")
        for step in script_steps:
            results.append(await step(evaluate))
    return results, errors


async def wait_for(evaluate, expr: str, what: str, seconds: float = 90.0):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = await evaluate(expr)
        if value:
            return value
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


