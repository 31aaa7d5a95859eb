"""The pack inside a real ComfyUI (headless, CPU): runs only when ``COMFYUI_DIR`` points at a
ComfyUI checkout; skipped otherwise (see README "Use in ComfyUI" for the setup).

``$COMFYUI_PYTHON`` (default: this interpreter) runs ComfyUI; it needs ComfyUI's requirements
(torch 2.9.1 + torchaudio 2.9.* on CPU), this pack's requirements, and ``aiohttp`` here for the
websocket. The server starts with ``--cpu`` and ``--extra-model-paths-config`` whose
``custom_nodes`` entry holds a link to this repository and whose model folders hold the tiny
assets (the LTX-2.3 checkpoint plus a tiny audio VAE + vocoder built with ComfyUI's own
classes, so ``LTXVAudioVAELoader`` accepts it). Then:

* ``/object_info`` lists our eight nodes with tooltips;
* every API-format workflow (``workflows/api``), pointed at the tiny models and shrunk to a
  64x64, 9-frame latent, is POSTed to ``/prompt``; ``/ws`` is followed to the end (progress
  events of our sampler node seen), ``/history`` says success and the saved video files exist;
* Stop: ``POST /interrupt`` during a 300-step SP sampling ends it (``execution_interrupted``)
  and the next prompt still runs on the same pool;
* ``GET /ltx_mgpu/status`` (and under ``/api``) and ``POST /ltx_mgpu/free``;
* headless Chromium (``$CHROMIUM``, default ``/usr/bin/chromium``) opens ComfyUI's page, finds
  the panel (sidebar tab, or the floating panel on frontends without sidebar tabs), sees the
  pool's state, and no console error mentions ltx_mgpu.
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

import pytest

REPO = Path(__file__).resolve().parent.parent
COMFYUI_DIR = os.environ.get("COMFYUI_DIR")
COMFYUI_PYTHON = os.environ.get("COMFYUI_PYTHON", sys.executable)
OUR_NODES = ("LTXMGPU_Pool", "LTXMGPU_PoolStatus", "LTXMGPU_Free", "LTXMGPU_GemmaLoader", "LTXMGPU_PromptEncode",
             "LTXMGPU_PromptBatchEncode", "LTXMGPU_ModelLoader", "LTXMGPU_SPSampler")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not COMFYUI_DIR or not (Path(COMFYUI_DIR or ".") / "main.py").is_file(),
                       reason="COMFYUI_DIR does not point at a ComfyUI checkout (README: 'Use in ComfyUI' > tests "
                              "against a real ComfyUI); these tests need ComfyUI's own environment with torchaudio"),
]

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
vocoder = {"resblock_kernel_sizes": [3], "upsample_rates": [2, 2], "upsample_kernel_sizes": [4, 4],
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, dict | str]:
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


@pytest.fixture(scope="module")
def server(tiny_gemma_dir, tiny_ltx_23):
    pytest.importorskip("aiohttp", reason="the /ws client needs aiohttp (a ComfyUI requirement)")
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
    (root / "custom_nodes").mkdir()
    (root / "custom_nodes" / "ltx-mgpu").symlink_to(REPO, target_is_directory=True)
    extra = root / "extra_model_paths.yaml"
    extra.write_text(f"ltx_mgpu_test:\n  base_path: {root}\n  checkpoints: models/checkpoints\n"
                     "  text_encoders: models/text_encoders\n  diffusion_models: models/diffusion_models\n"
                     "  loras: models/loras\n  custom_nodes: custom_nodes\n")
    output = root / "output"
    for d in (output, root / "input", root / "temp"):
        d.mkdir()
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LTX_MGPU_RUNTIME_DIR": str(runtime),
           "LTX_MGPU_CACHE_DIR": str(root / "cache"), "PYTHONUNBUFFERED": "1"}
    log = root / "comfyui.log"
    cmd = [COMFYUI_PYTHON, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
           "--extra-model-paths-config", str(extra), "--output-directory", str(output),
           "--input-directory", str(root / "input"), "--temp-directory", str(root / "temp"),
           "--disable-auto-launch"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=COMFYUI_DIR, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    srv = Server(f"http://127.0.0.1:{port}", output, log, proc)
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"ComfyUI exited:\n{srv.log_tail()}"
            with contextlib.suppress(OSError):
                if _http(f"{srv.url}/object_info/LTXMGPU_Pool", timeout=5)[0] == 200:
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


def _tiny(api: dict, steps: int = 2) -> dict:
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


async def _run(srv: Server, prompt: dict, on_message=None, timeout: float = 900.0) -> tuple[str, list[dict]]:
    """POST ``prompt``, follow ``/ws`` until it finishes; ``(prompt_id, messages)``."""
    import aiohttp

    client_id = uuid.uuid4().hex
    messages: list[dict] = []
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{srv.url.replace('http', 'ws')}/ws?clientId={client_id}") as ws:
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


def _api(name: str) -> dict:
    return json.loads((REPO / "workflows" / "api" / f"{name}.api.json").read_text())


def test_object_info_lists_our_nodes_with_tooltips(server):
    status, info = _http(f"{server.url}/object_info")
    assert status == 200
    for nid in OUR_NODES:
        assert nid in info, f"{nid} not registered:\n{server.log_tail()}"
        assert info[nid]["category"] == "LTX-2 Multi-GPU"
        for spec in info[nid]["input"]["required"].values():
            assert spec[1].get("tooltip")


@pytest.mark.parametrize("name", ["ltx_mgpu_precompute_prompts", "ltx_mgpu_text_to_video", "ltx_mgpu_encode_core_sampler"])
def test_every_api_workflow_runs(server, name):
    prompt = _tiny(_api(name))
    prompt_id, messages = asyncio.run(_run(server, prompt))
    errors = [m for m in messages if m["type"] in ("execution_error", "execution_interrupted")]
    assert not errors, f"{json.dumps(errors)[:4000]}\n{server.log_tail()}"
    status, history = _http(f"{server.url}/history/{prompt_id}")
    entry = history[prompt_id]
    assert entry["status"]["completed"] and entry["status"]["status_str"] == "success"
    outputs = entry["outputs"]
    for node_id, node in prompt.items():
        if node["class_type"] == "SaveVideo":
            files = outputs[node_id]["images"]
            assert files and all((server.output / f["subfolder"] / f["filename"]).stat().st_size > 0 for f in files)
        if node["class_type"] == "LTXMGPU_SPSampler":
            steps = [m["data"] for m in messages if m["type"] == "progress" and m["data"].get("node") == node_id]
            assert steps and steps[-1]["value"] == steps[-1]["max"] == 2
        if node["class_type"] == "LTXMGPU_PromptBatchEncode":
            assert outputs[node_id]["text"][0].startswith("4 prompts:")


def test_stop_interrupts_sp_sampling_and_the_pool_keeps_serving(server):
    prompt = _tiny(_api("ltx_mgpu_text_to_video"), steps=300)
    sampler = next(k for k, v in prompt.items() if v["class_type"] == "LTXMGPU_SPSampler")
    sent = {}

    async def on_message(session, data):
        if data["type"] == "progress" and data["data"].get("node") == sampler and not sent:
            sent["at"] = data["data"]["value"]
            async with session.post(f"{server.url}/interrupt", json={}) as r:
                assert r.status == 200

    _, messages = asyncio.run(_run(server, prompt, on_message))
    assert sent and messages[-1]["type"] == "execution_interrupted", messages[-3:]
    last = [m["data"]["value"] for m in messages if m["type"] == "progress" and m["data"].get("node") == sampler]
    assert max(last) < 300
    again = _tiny(_api("ltx_mgpu_text_to_video"))
    again[sampler]["inputs"]["seed"] = 7  # not a cached result: the sampler really runs on the same pool
    _, messages = asyncio.run(_run(server, again))
    assert messages[-1]["type"] == "executing", messages[-3:]
    assert any(m["type"] == "progress" and m["data"].get("node") == sampler for m in messages)


def test_status_and_free_routes(server):
    for prefix in ("", "/api"):
        status, payload = _http(f"{server.url}{prefix}/ltx_mgpu/status")
        assert status == 200 and payload["available"] is True
        pool = next(p for p in payload["pools"] if p["key"] == "cpu-2")
        assert pool["state"] == "idle" and len(pool["ranks"]) == 2
    status, freed = _http(f"{server.url}/ltx_mgpu/free", {"stop": False})
    assert status == 200 and next(p for p in freed["pools"] if p["key"] == "cpu-2")["running"] is True


# --------------------------------------------------------------------------- the web panel in Chromium


async def _cdp_page(ws_url: str, script_steps, timeout: float = 120.0):
    """Drive one page over the Chrome DevTools Protocol; returns (results, console errors)."""
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
                    errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in msg["params"]["args"]))
                elif msg.get("method") == "Runtime.exceptionThrown":
                    errors.append(json.dumps(msg["params"]["exceptionDetails"])[:2000])
                elif msg.get("method") == "Log.entryAdded" and msg["params"]["entry"]["level"] == "error":
                    errors.append(f"{msg['params']['entry'].get('text')} {msg['params']['entry'].get('url', '')}")
                elif msg.get("id") == mid:
                    return msg.get("result", {})

        async def evaluate(expr):
            out = await call("Runtime.evaluate", {"expression": expr, "awaitPromise": True, "returnByValue": True})
            return out.get("result", {}).get("value")

        await call("Runtime.enable")
        await call("Log.enable")
        for step in script_steps:
            results.append(await step(evaluate))
    return results, errors


def test_panel_in_headless_chromium_shows_the_pool(server):
    chromium = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("no Chromium (Debian: apt-get install chromium); set $CHROMIUM to its path")
    _run_small = _tiny(_api("ltx_mgpu_precompute_prompts"))
    asyncio.run(_run(server, _run_small))  # the pool is up and idle
    port = _free_port()
    profile = tempfile.mkdtemp(prefix="ltxm-chromium-")
    proc = subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                             "--disable-background-networking", "--disable-component-update", "--disable-sync",
                             f"--user-data-dir={profile}", f"--remote-debugging-port={port}", "--window-size=1400,900",
                             server.url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        target = None
        while target is None:
            assert time.monotonic() < deadline, "Chromium did not open a debuggable page"
            with contextlib.suppress(OSError, ValueError):
                pages = _http(f"http://127.0.0.1:{port}/json/list")[1]
                target = next((p for p in pages if p.get("type") == "page" and server.url in p.get("url", "")), None)
            time.sleep(0.5)

        async def wait_for(evaluate, expr, what, seconds=90):
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                value = await evaluate(expr)
                if value:
                    return value
                await asyncio.sleep(0.5)
            raise AssertionError(f"timed out waiting for {what}")

        async def loaded(evaluate):
            return await wait_for(evaluate, "window.ltxMgpu ? window.ltxMgpu.mode() : null", "our extension")

        async def open_panel(evaluate):
            return await evaluate("""(async () => {
                const btn = document.querySelector('.ltx-mgpu-status-tab-button, [class*="ltx-mgpu-status"]');
                if (btn) { btn.click(); return 'clicked sidebar tab'; }
                const t = document.querySelector('.ltx-mgpu-toggle');
                if (t) { t.click(); return 'opened floating panel'; }
                return 'no tab button found';
            })()""")

        async def pool_state(evaluate):
            return await wait_for(evaluate, """(() => {
                const p = document.querySelector('.ltx-mgpu-panel .ltx-mgpu-pool[data-state]');
                return p ? p.dataset.state + ' | ' + p.textContent : null; })()""", "the pool in the panel")

        (mode, opened, state), errors = asyncio.run(_cdp_page(target["webSocketDebuggerUrl"],
                                                              [loaded, open_panel, pool_state]))
        assert mode in ("sidebar", "floating") and opened != "no tab button found", (mode, opened)
        assert state.split(" | ")[0] in ("idle", "busy") and "rank 0" in state and "rank 1" in state, state
        ours = [e for e in errors if "ltx_mgpu" in e or "ltx-mgpu" in e]
        assert not ours, ours
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        shutil.rmtree(profile, ignore_errors=True)
