"""No silent minute: the words of each phase (``ltx_mgpu.client.phases``), the heartbeat that keeps a
phase without steps moving (``ltx_mgpu.heartbeat``), and where it shows: the Gemma 3 270M
conversion's stage lines, the CLI's bars redrawn while nothing reports, a node's phase text in
ComfyUI (the pool starting, a model load, the pool's own phases) and the panel's "starting" state.

The heartbeats are driven by an injected ``wait`` (or a tiny interval, waited for by count), so
nothing here depends on how fast the machine is, and no duration is asserted.
"""

from __future__ import annotations

import io
import re
import threading
import time
from types import SimpleNamespace

import pytest
from nodes_support import bridge, routes, runtime

from ltx_mgpu.assets.gemma270m import STAGES, StageReport
from ltx_mgpu.cli.generate import ProgressBars
from ltx_mgpu.client.phases import PHASE_LABELS, phase_label, phase_text
from ltx_mgpu.heartbeat import Heartbeat


def ticks(n: int):
    """A ``wait`` that lets ``n`` beats through at once, then ends the heartbeat."""
    left = [n]

    def wait(_seconds: float) -> bool:
        left[0] -= 1
        return left[0] < 0

    return wait


def test_phase_text_names_the_phase_its_count_and_the_whole_seconds():
    assert phase_text("pool", 12.7) == "starting the pool · 12 s"
    assert phase_text("denoise", 41.2, 3, 20) == "denoising 3/20 · 41 s"
    assert phase_text("load_transformer", 0.4, 0, 1) == "loading the LTX-2 transformer · 0 s"
    assert phase_label("something_new") == "something new"
    assert set(PHASE_LABELS) >= {"pool", "load_text_encoder", "encode", "load_transformer", "denoise", "decode"}


def test_heartbeat_beats_until_stopped_and_a_failing_display_never_reaches_the_work():
    seen = []
    with Heartbeat(seen.append, interval=5.0, wait=ticks(3)) as hb:
        hb._thread.join(5)
    assert len(seen) == 3 and all(s >= 0 for s in seen) and hb.beats == 3

    def broken(_):
        raise RuntimeError("a closed terminal")

    with Heartbeat(broken, wait=ticks(5)) as hb:
        hb._thread.join(5)
    assert hb.beats == 0  # stopped at the first failure, raised nowhere


def test_the_270m_conversion_says_each_stage_and_keeps_talking_while_one_runs():
    lines: list[str] = []
    allowed, done = threading.Semaphore(0), threading.Event()

    def wait(_seconds: float) -> bool:  # a beat each time the test allows one
        while not done.is_set():
            if allowed.acquire(timeout=0.01):
                return False
        return True

    with StageReport(lines.append, interval=5.0, wait=wait) as stages:
        stages.stage(0)
        stages.stage(1)
        allowed.release(2)  # two heartbeats while the weights load
        deadline = time.monotonic() + 60
        while len(lines) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        done.set()
    stages.stage(len(STAGES))
    assert lines[0] == "[1/4] assembling the GGUF from its package"
    assert lines[1] == "[2/4] loading the GGUF weights in bf16"
    assert lines[2].startswith("      loading the GGUF weights in bf16: ") and lines[2].endswith(" s")
    assert lines[3].startswith("      loading the GGUF weights in bf16: ")
    assert lines[-1].startswith("converted the Gemma 3 270M in ") and "assemble " in lines[-1]


def test_cli_bars_are_redrawn_while_a_phase_reports_nothing(monkeypatch):
    err = io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    bars = ProgressBars(True, refresh=0.01)
    bars("pool", 0, 1)  # starting the pool: one step, reported at the end
    deadline = time.monotonic() + 60
    while bars.redraws < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    bars("pool", 1, 1)
    bars.close()
    assert bars.redraws >= 3
    assert "pool" in err.getvalue() and "1/1" in err.getvalue()
    quiet = ProgressBars(False)
    quiet("pool", 0, 1)
    quiet.close()
    assert quiet.redraws == 0


def test_a_compile_is_a_phase_that_begins_and_ends():
    """The pool's job shows a first compile of the fp8 blocks as the ``compile`` phase: a log line
    and step 0 of 1 when it begins, a log line and 1 of 1 when the first pass is done, so the CLI's
    ``compile`` bar closes there instead of running on through the denoising."""
    from ltx_mgpu.pool.denoise_jobs import announce_compile

    said, events = [], []
    ctx = SimpleNamespace(log=said.append, progress=lambda *event: events.append(event))
    announce_compile(ctx, "compiling the transformer blocks for up to 6,144 video tokens, first time at this size: "
                          "up to a minute")
    announce_compile(ctx, "compiled the transformer blocks for up to 6,144 video tokens in 39 s", done=True)
    assert events == [("compile", 0, 1), ("compile", 1, 1)] and len(said) == 2
    assert phase_label("compile") == "compiling" and ProgressBars.LABELS["compile"] == "compile"
    err = io.StringIO()
    bars = ProgressBars(True, refresh=60)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.stderr", err)
        for event in events:
            bars(*event)
        assert "compile" not in bars.bars  # closed at 1/1
        bars.close()


class _Starting:
    """A pool client of this process in the middle of starting its pool."""

    def __init__(self, directory: str, since: float):
        self.spec = SimpleNamespace(dir=directory, key="cpu-2", gpus=(), nproc=2, device="cpu", lifetime="with-owner")
        self.starting_since = since


@pytest.fixture
def starting_client(monkeypatch, tmp_path):
    client = _Starting(str(tmp_path / "cpu-2"), time.monotonic() - 12.5)
    monkeypatch.setitem(runtime._CLIENTS, client.spec.dir, client)
    return client


def test_a_node_shows_the_pool_starting_then_its_named_phase_then_the_pools_progress(starting_client):
    watch = runtime.JobWatch("7")
    assert watch.current_phase() == "starting the pool · 12 s"
    starting_client.starting_since = None
    assert watch.current_phase() is None
    with watch.phase("load_transformer"):
        assert watch.current_phase() == "loading the LTX-2 transformer · 0 s"
    watch.on_progress("denoise", 3, 20)
    assert watch.current_phase() == "denoising 3/20 · 0 s"


def test_the_heartbeat_puts_the_phase_on_the_node_and_ends_with_the_outcome(starting_client):
    shown: list[tuple[str, str]] = []
    bridge.set_progress_text_hook(lambda node, text: shown.append((node, text)))
    try:
        with runtime.JobWatch("7", heartbeat=0.01) as watch:
            deadline = time.monotonic() + 60
            while not watch.texts and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        bridge.set_progress_text_hook(None)
    assert shown[0] == ("7", "starting the pool · 12 s")
    assert shown[-1][0] == "7" and re.fullmatch(r"done in \d+ s", shown[-1][1]), shown[-1]


def test_the_panel_payload_says_starting_while_a_node_starts_the_pool(starting_client, monkeypatch):
    monkeypatch.setattr(routes, "pool_specs", lambda: [starting_client.spec])
    monkeypatch.setattr(routes, "pool_unavailable_reason", lambda: None)
    (pool,) = routes.status_payload()["pools"]
    assert pool["state"] == "starting"
    assert pool["current"]["type"] == "start" and pool["current"]["progress"]["phase"] == "pool"
    assert pool["current"]["elapsed"] >= 12
