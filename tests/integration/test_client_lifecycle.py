"""The client's pool lifecycle against a fake pool (``tests/fake_pool.py``: the real socket server,
a stub job loop, no torchrun): attach instead of a second start, a fresh pool after a fatal
error or a silent death (the lost pool's processes swept), the kill after a cancel timeout, Stop
at a step boundary, stale files, and a with-owner pool ending with its owner. Each test takes
seconds; ``tests/integration/test_pool_lifecycle.py`` runs the same situations against real pools.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from pool_support import cleanup, short_dir

from ltx_mgpu.client import jobs, launch
from ltx_mgpu.client.errors import JobCancelledError, PoolFatalError
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.wire import rendezvous

FAKE = Path(__file__).resolve().parents[1] / "fake_pool.py"
HERE = Path(__file__).resolve().parent  # this file, which the child scripts import


def fake_command(spec, port, owner):
    """``launch.torchrun_command`` for the fake pool (same runtime directory, ranks and owner)."""
    cmd = [sys.executable, str(FAKE), "--runtime-dir", str(spec.dir), "--ranks", str(spec.nproc),
           "--lifetime", spec.lifetime]
    if owner is not None:
        cmd += ["--owner-pid", str(owner[0]), "--owner-create-time", repr(owner[1])]
    return cmd


@pytest.fixture()
def rt(monkeypatch):
    """A private runtime base whose pools are fake ones."""
    monkeypatch.setattr(launch, "torchrun_command", fake_command)
    base = short_dir()
    yield base
    for info in [rendezvous.PoolInfo.read(d) for d in base.iterdir() if d.is_dir()]:
        if info is not None:
            launch.stop(Path(info.dir), graceful=False)
    cleanup(base)


def behave(client: PoolClient, behaviour: str) -> None:
    """What the fake pool of ``client``'s GPU set does with its next jobs."""
    (client.dir / "fake_behaviour").write_text(behaviour)


def pool_pids(client: PoolClient) -> list[int]:
    return [client.pool["torchrun_pid"]] + [r["pid"] for r in client.pool["ranks"][1:]]


def gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.05)
    return False


def connect(base: Path, **kw) -> PoolClient:
    return PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, lifetime="detached", startup_timeout=30, **kw)


def test_a_second_client_attaches_to_the_running_pool(rt):
    first = connect(rt)
    try:
        assert first.launched and first.request("selftest", {"steps": 2}, timeout=10)[0]["steps_done"] == 2
        second = connect(rt)
        assert not second.launched and second.pid == first.pid
        assert second.request("selftest", {"steps": 1}, timeout=10)[0]["pid"] == first.pid
        assert second.status()["pool"]["world_size"] == 2
        second.close()
    finally:
        first.shutdown()
    assert gone(pool_pids(first)) and not (rt / "cpu-2" / rendezvous.INFO_NAME).exists()


def test_a_request_over_the_frame_limit_is_bad_input_and_the_connection_serves_on(rt, monkeypatch):
    import torch

    from ltx_mgpu.client.errors import BadInputError

    client = connect(rt)
    try:
        pid = client.pid
        monkeypatch.setenv("LTX_MGPU_MAX_PAYLOAD_BYTES", "1024")  # this client's limit; the pool keeps its own
        with pytest.raises(BadInputError, match=r"the sample request: payload is \d+ bytes, over the 1024-byte limit"):
            client.request("sample", {"positive": [], "latent": {}}, {"x": torch.zeros(1024)}, timeout=10)
        assert client.request("selftest", {"steps": 1}, timeout=10)[0]["pid"] == pid  # nothing was sent
    finally:
        client.shutdown()


def test_a_fatal_error_ends_the_job_and_the_next_request_gets_a_fresh_pool(rt):
    client = connect(rt)
    try:
        old = pool_pids(client)
        behave(client, "fatal")
        with pytest.raises(PoolFatalError, match="deliberate fault"):
            client.request("selftest", {"steps": 3}, timeout=10)
        assert gone(old)
        behave(client, "serve")
        assert client.request("selftest", {"steps": 1}, timeout=10)[0]["pid"] not in old
    finally:
        client.shutdown()


def test_a_pool_that_dies_without_a_word_is_swept_and_replaced(rt):
    """kill -9 of torchrun's stand-in leaves its ranks running: the client that sees the loss
    kills them (the processes it saw at attach), without another request, and starts a fresh
    pool on the next request."""
    client = connect(rt)
    try:
        old = pool_pids(client)
        behave(client, "die")
        with pytest.raises(PoolFatalError):
            client.request("selftest", {"steps": 3}, timeout=10)
        assert gone(old)  # the orphaned rank too
        behave(client, "serve")
        assert client.request("selftest", {"steps": 1}, timeout=10)[0]["pid"] not in old
        assert gone(old)
    finally:
        client.shutdown()


def test_a_job_that_ignores_its_cancel_gets_the_pool_killed_after_the_cancel_timeout(rt, monkeypatch):
    monkeypatch.setattr(jobs, "CANCEL_TIMEOUT_S", 0.5)
    client = connect(rt)
    try:
        old = pool_pids(client)
        behave(client, "hang")
        t0 = time.monotonic()
        with pytest.raises(PoolFatalError, match="did not stop selftest job .* within 0s of a cancel|within 1s"):
            client.request("selftest", {"steps": 3}, should_cancel=lambda: True, timeout=30)
        assert time.monotonic() - t0 < 5 and gone(old)
        behave(client, "serve")
        assert client.request("selftest", {"steps": 1}, timeout=10)[0]["pid"] not in old
    finally:
        client.shutdown()


def test_stop_ends_a_job_at_its_next_step_and_the_same_pool_serves_on(rt):
    client = connect(rt)
    try:
        seen = []
        with pytest.raises(JobCancelledError, match="cancelled after"):
            client.request("selftest", {"steps": 100, "step_seconds": 0.05}, on_progress=lambda *p: seen.append(p),
                           should_cancel=lambda: len(seen) >= 2, timeout=30)
        assert 2 <= len(seen) < 100
        pid = client.pid
        assert client.request("selftest", {"steps": 1}, timeout=10)[0]["pid"] == pid
    finally:
        client.shutdown()


def test_a_pool_that_died_leaves_no_files_and_stale_ones_do_not_stop_a_start(rt):
    """The client that sees its pool die removes the socket, token and pool.json once torchrun is
    gone (without another request); files of a pool nobody saw die are swept at the next start."""
    client = connect(rt)
    d = client.dir
    behave(client, "die")
    with pytest.raises(PoolFatalError):
        client.request("selftest", {"steps": 1}, timeout=10)
    deadline = time.monotonic() + 5
    while (d / rendezvous.INFO_NAME).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any((d / n).exists() for n in (rendezvous.INFO_NAME, rendezvous.TOKEN_NAME, rendezvous.SOCKET_NAME))
    client.close()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    info = rendezvous.PoolInfo(pid=int(dead.stdout), create_time=0.0, gpus=[], nproc=2, device="cpu",
                            version="0", protocol=1, start_time=0.0, lifetime="detached", owner_pid=None,
                            master_port=1, instance="stale", dir=str(d))
    info.write()
    rendezvous.write_private(d / rendezvous.TOKEN_NAME, b"stale")
    (d / "fake_behaviour").write_text("serve")
    fresh = connect(rt)
    try:
        assert fresh.launched and fresh.request("selftest", {"steps": 1}, timeout=10)[0]["steps_done"] == 1
    finally:
        fresh.shutdown()


def test_a_with_owner_pool_ends_with_its_owner(rt):
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(HERE)!r}, {str(FAKE.parent)!r}, {str(FAKE.parent.parent)!r}]
        from ltx_mgpu.client import launch
        from ltx_mgpu.client.pool_client import PoolClient
        from test_client_lifecycle import fake_command
        launch.torchrun_command = fake_command
        c = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir={str(rt)!r}, startup_timeout=30)
        print(c.pid, *[r["pid"] for r in c.pool["ranks"][1:]], flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2 and gone(pids)
    assert launch.find_live_pool(rt / "cpu-2") is None


# --------------------------------------------------------------------------- a pool started for one run


def test_a_pool_started_for_a_run_is_handed_over_not_stopped_under_another_clients_job(rt):
    """Issue 29, finding 8: two ``encode --pool`` racing on an empty runtime directory: the one
    that started the pool finished first and stopped it under the other's running job
    ("cancelled after 2 step boundaries"). Releasing a pool started for a run stops it only when
    no other client holds it or has a job in it; it is handed over to them otherwise."""
    starter = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=rt, startup_timeout=30)  # with-owner: this process
    assert starter.launched
    other = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=rt, start=False)  # attached, holds nothing
    pids = pool_pids(starter)
    job = other.submit("selftest", {"steps": 100000, "step_seconds": 0.02})
    first = next(ev for ev in job.events(timeout=10) if ev["event"] == "progress")["step"]
    assert starter.release() is False  # handed over: the other client's job runs on
    assert next(ev for ev in job.events(timeout=10) if ev["event"] == "progress" and ev["step"] > first + 3)
    assert other.status()["owner_left"].startswith("the client that started it")
    other.cancel(job.id)
    with pytest.raises(JobCancelledError):
        job.wait(timeout=10)
    # the starter has left, no client holds the pool and its last job ended: it stops by itself
    assert gone(pids) and launch.find_live_pool(rt / "cpu-2") is None
    other.close()


def test_a_client_that_would_start_its_own_pool_holds_a_handed_over_one_until_it_leaves(rt):
    """The attached client has no job at the starter's release, but would start a pool of its
    own without this one (``hold``): the pool waits for it, and stops when it closes."""
    starter = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=rt, startup_timeout=30)
    holder = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=rt, startup_timeout=30)
    pids = pool_pids(starter)
    assert not holder.launched and holder.pid == starter.pid
    assert starter.release() is False
    assert holder.request("selftest", {"steps": 2}, timeout=10)[0]["steps_done"] == 2
    assert holder.status()["holders"] == 1
    holder.close()
    assert gone(pids)


def test_releasing_a_pool_nobody_else_uses_stops_it(rt):
    starter = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=rt, startup_timeout=30)
    observer = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=rt, start=False)  # a status-only client
    pids = pool_pids(starter)
    assert starter.release() is True
    assert gone(pids, timeout=1.0) and launch.find_live_pool(rt / "cpu-2") is None
    observer.close()


def test_a_with_owner_pool_whose_owner_dies_serves_the_clients_that_hold_it_then_stops(rt):
    """The owner process exits without a word (no release) while another client holds the pool:
    the pool serves that client on, and stops once it leaves."""
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(HERE)!r}, {str(FAKE.parent)!r}, {str(FAKE.parent.parent)!r}]
        from ltx_mgpu.client import launch
        from ltx_mgpu.client.pool_client import PoolClient
        from test_client_lifecycle import fake_command
        launch.torchrun_command = fake_command
        c = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir={str(rt)!r}, startup_timeout=30)
        print(c.pid, flush=True)
        sys.stdin.readline()
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pid = int(owner.stdout.readline())
        holder = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=rt, startup_timeout=30)
        assert holder.pid == pid and not holder.launched
        pids = pool_pids(holder)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while holder.status()["owner_left"] is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert holder.status()["owner_left"] == f"its owner process {owner.pid} exited"
        assert holder.request("selftest", {"steps": 1}, timeout=10)[0]["pid"] == pid
        holder.close()
        assert gone(pids)
    finally:
        owner.kill()
        owner.wait()


# --------------------------------------------------------------------------- racing starters


def test_a_look_without_the_launch_lock_never_removes_the_files_of_a_pool_being_started():
    """Issue 29, finding 9: four ``pool start --detach`` racing started a second pool, and a
    starter died with torchrun's ChildFailedError: a starter's first look (outside the launch
    lock) found a token but no ``pool.json`` yet, called the files stale and removed them while
    the pool holding the lock was starting (its rank 0 then found no token). Files are removed
    only under the lock."""
    base = short_dir()
    try:
        d = rendezvous.ensure_private_dir(base / "cpu-2")
        with rendezvous.launch_lock(d):  # another process is starting a pool here
            rendezvous.write_private(d / rendezvous.TOKEN_NAME, b"fresh")
            assert launch.find_live_pool(d) is None
            assert (d / rendezvous.TOKEN_NAME).read_bytes() == b"fresh"
        assert launch.find_live_pool(d) is None  # no launch under way: a token alone is stale
        assert not (d / rendezvous.TOKEN_NAME).exists()
    finally:
        cleanup(base)
