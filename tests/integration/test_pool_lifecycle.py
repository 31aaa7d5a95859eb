"""Pool lifecycles with real processes: CLI start/attach/stop, rank death, fatal errors, busy
ports and stale files, owner death, the release of shared-memory arenas. Every test has its own
runtime dir and cleans it up."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
import torch
from pool_support import ENV, cleanup, cpu_load, pool_pids, running, short_dir, wait_all_gone

from ltx_mgpu.client import launch
from ltx_mgpu.client.errors import PoolFatalError
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.client.spec import resolve_spec
from ltx_mgpu.wire import rendezvous

REPO = launch.repo_root()


@pytest.fixture
def base():
    b = short_dir()
    yield b
    cleanup(b)


def _cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "ltx_mgpu", "pool", *args], cwd=REPO, env=ENV, timeout=timeout,
                          capture_output=True, text=True)


def test_cli_detached_pool_is_attached_not_duplicated_and_stays_until_stopped(base):
    common = ["--gpus", "cpu", "--nproc", "2", "--runtime-dir", str(base)]
    out = _cli("start", "--detach", *common)
    assert out.returncode == 0, out.stderr
    info = rendezvous.PoolInfo.read(base / "cpu-2")
    assert f"started pool pid {info.pid}" in out.stdout and info.lifetime == "detached"
    assert info.alive()  # the CLI has exited; the detached pool stays

    first = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base)
    second = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base)
    assert first.pid == second.pid == info.pid
    assert first.request("selftest", {"steps": 1}, timeout=30)[0]["allreduce_ok"]
    again = _cli("start", "--detach", *common)
    assert again.returncode == 0 and f"already running: pid {info.pid}" in again.stdout
    status = _cli("status", *common)
    assert status.returncode == 0 and f"pool pid {info.pid}" in status.stdout and "lifetime detached" in status.stdout
    everything = _cli("status", "--runtime-dir", str(base))  # no --gpus: every pool under the base
    assert everything.returncode == 0 and f"pool pid {info.pid}" in everything.stdout
    pids = pool_pids(first)
    first.close()
    second.close()
    assert len(running(pids)) == len(pids)  # still running after its clients left

    stop = _cli("stop", *common)
    assert stop.returncode == 0 and f"stopped pool pid {info.pid}" in stop.stdout
    assert wait_all_gone(pids) == []
    assert not (base / "cpu-2" / rendezvous.SOCKET_NAME).exists() and rendezvous.PoolInfo.read(base / "cpu-2") is None
    assert _cli("status", *common).returncode == 1


def test_kill_9_of_a_rank_mid_job_reports_fatal_and_next_request_gets_a_fresh_pool(base):
    client = PoolClient.connect(gpus="cpu", nproc=4, runtime_dir=base, startup_timeout=120)
    try:
        result, tensors = client.request("selftest", {"steps": 1}, timeout=30)
        assert result["world_size"] == 4 and result["expected"] == 10.0 and result["allreduce_ok"]
        old = pool_pids(client)
        job = client.submit("selftest", {"steps": 100000, "step_seconds": 0.05})
        for ev in job.events(timeout=30):
            if ev["event"] == "progress" and ev["step"] >= 2:
                break
        os.kill(client.pool["ranks"][2]["pid"], signal.SIGKILL)
        with pytest.raises(PoolFatalError) as err:
            for _ in job.events(timeout=10):  # PoolTimeoutError if the pool went silent for 10 s
                pass
            job.wait(timeout=5)
        assert "pool" in str(err.value)

        result, _ = client.request("selftest", {"steps": 1}, timeout=60)
        assert result["allreduce_ok"] and result["world_size"] == 4
        assert client.pid != old[0][0]
        assert running(old) == []  # nothing of the old pool remains

        # torchrun itself told to stop (SIGTERM) mid-job: rank 0 still tells the client why
        old = pool_pids(client)
        job = client.submit("selftest", {"steps": 100000, "step_seconds": 0.05})
        next(ev for ev in job.events(timeout=30) if ev["event"] == "progress")
        os.kill(client.pid, signal.SIGTERM)
        with pytest.raises(PoolFatalError, match=r"terminated \(SIGTERM\)"):
            for _ in job.events(timeout=10):
                pass
            job.wait(timeout=5)
        assert client.request("selftest", {"steps": 1}, timeout=60)[0]["allreduce_ok"]
        assert running(old) == []
    finally:
        client.shutdown()


def test_after_kill_9_of_rank_0_the_client_that_saw_it_removes_the_pool_files(base):
    """The pool cannot clean up after a kill -9 of rank 0; the client whose connection broke
    proves the pool gone (torchrun exited) and removes the socket, token and pool.json, so no one
    finds a dead pool's files (before: they stayed until the next start)."""
    client = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, startup_timeout=120)
    try:
        d, old = client.dir, pool_pids(client)
        os.kill(client.pool["ranks"][0]["pid"], signal.SIGKILL)
        assert wait_all_gone(old, timeout=60) == []
        deadline = time.monotonic() + 30
        names = (rendezvous.SOCKET_NAME, rendezvous.TOKEN_NAME, rendezvous.INFO_NAME)
        while any((d / n).exists() for n in names) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [n for n in names if (d / n).exists()]
    finally:
        client.close()


@pytest.mark.parametrize("fail_rank", [1, 0])
def test_unexpected_exception_is_fatal_and_the_pool_exits_cleanly(base, fail_rank):
    client = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, startup_timeout=120)
    try:
        old = pool_pids(client)
        with pytest.raises(PoolFatalError, match=f"injected failure on rank {fail_rank} at step 1"):
            client.request("selftest", {"steps": 5, "fail_rank": fail_rank, "fail_step": 1}, timeout=30)
        assert wait_all_gone(old) == []
        assert not (client.dir / rendezvous.SOCKET_NAME).exists() and rendezvous.PoolInfo.read(client.dir) is None
        assert client.request("selftest", {"steps": 1}, timeout=60)[0]["allreduce_ok"]
        assert client.pid != old[0][0]
    finally:
        client.shutdown()


def test_busy_rendezvous_port_and_stale_files_do_not_stop_a_start(base):
    d = rendezvous.ensure_private_dir(base / "cpu-2")
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(d / rendezvous.SOCKET_NAME))  # a socket file nobody listens on
    stale.close()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    rendezvous.PoolInfo(pid=dead.pid, create_time=0.0, gpus=[], nproc=2, device="cpu", version="0", protocol=1,
                    start_time=0.0, lifetime="detached", owner_pid=None, master_port=1, instance="stale",
                    dir=str(d)).write()
    busy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        client = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, master_port=port, startup_timeout=120)
        try:
            assert client.request("selftest", {"steps": 1}, timeout=30)[0]["allreduce_ok"]
            log = (d / rendezvous.LOG_NAME).read_text()
            assert f"attempt 1, master port {port}" in log and launch.is_port_conflict(log) and "attempt 2" in log
            assert rendezvous.PoolInfo.read(d).master_port != port
        finally:
            client.shutdown()
    finally:
        busy.close()


def test_with_owner_pool_exits_when_its_owner_dies(base):
    script = ("import json, sys\nfrom ltx_mgpu.client.pool_client import PoolClient\n"
              "c = PoolClient.connect(gpus='cpu', nproc=2, runtime_dir=sys.argv[1], startup_timeout=120)\n"
              "print(json.dumps(c.pool), flush=True)\nsys.stdin.read()\n")
    owner = subprocess.Popen([sys.executable, "-c", script, str(base)], cwd=REPO, env=ENV, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        pool = json.loads(owner.stdout.readline())
        assert pool["lifetime"] == "with-owner" and pool["owner_pid"] == owner.pid
        pids = [(pool["torchrun_pid"], None)] + [(r["pid"], r["create_time"]) for r in pool["ranks"]]
        assert len(running(pids)) == 3  # all running
        owner.kill()
        owner.wait()
        assert wait_all_gone(pids) == []
        assert rendezvous.PoolInfo.read(base / "cpu-2") is None
    finally:
        owner.kill()
        owner.wait()


def _arenas(pid: int) -> set[str]:
    """Inodes of the ltx_mgpu arenas process ``pid`` maps or holds open (memfds: no file-system name)."""
    found = set()
    with open(f"/proc/{pid}/maps") as f:
        found |= {line.split()[4] for line in f if "memfd:ltx_mgpu-arena" in line}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if "memfd:ltx_mgpu-arena" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                found.add(str(os.stat(f"/proc/{pid}/fd/{fd}").st_ino))
    return found


def _until(predicate, timeout=15.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.05)
    return predicate()


def test_arena_memory_goes_when_idle_when_the_client_leaves_and_with_the_pool(base, monkeypatch):
    monkeypatch.setenv("LTX_MGPU_SHM_IDLE_SECONDS", "1")  # read by the pool it starts
    client = PoolClient.connect(gpus="cpu", nproc=1, runtime_dir=base, startup_timeout=120)
    rank0, me = client.pool["ranks"][0]["pid"], os.getpid()
    pids = pool_pids(client)
    blob = torch.arange(251, dtype=torch.uint8).repeat(-(-(2 << 20) // 251))[:2 << 20]
    _, got = client.request("selftest", {"steps": 0, "result_bytes": 2 << 20}, timeout=30)
    assert torch.equal(got["blob"], blob) and client.shm_stats["frames"] == 1
    arena = _arenas(rank0)
    assert len(arena) == 1 and arena <= _arenas(me)  # one arena, mapped by the pool and by us
    # idle for a second: the pool drops it and tells the client, which unmaps it
    assert _until(lambda: not _arenas(rank0) and not arena & _arenas(me))
    assert not client.shm_stats["mapped"]
    _, got = client.request("selftest", {"steps": 0, "result_bytes": 2 << 20}, timeout=30)
    assert torch.equal(got["blob"], blob) and client.shm_stats["arenas"] == 2  # a fresh one on demand
    arena = _arenas(rank0)
    client.close()  # the client leaves: both sides let go
    assert _until(lambda: not _arenas(rank0) and not arena & _arenas(me))
    again = PoolClient.connect(gpus="cpu", nproc=1, runtime_dir=base, start=False)
    _, got = again.request("selftest", {"steps": 0, "result_bytes": 2 << 20}, timeout=30)
    arena = _arenas(rank0)
    assert torch.equal(got["blob"], blob) and arena <= _arenas(me)
    again.shutdown()  # the pool stops: nothing of the arena is left in this process either
    assert wait_all_gone(pids) == []
    assert _until(lambda: not arena & _arenas(me))


def test_worker_threads_default_to_physical_cores_per_rank_and_keep_the_callers_setting(monkeypatch):
    """PyTorch's default for one process is the physical cores; the pool's ranks share them."""
    import psutil

    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 32 if logical else 16)
    spec = resolve_spec("cpu", nproc=2)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    assert launch.worker_env(spec, env)["OMP_NUM_THREADS"] == "8"
    assert launch.worker_env(spec, {**env, "OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: None)  # unknown topology: os.cpu_count()
    assert launch.worker_env(spec, env)["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))


def test_a_bare_gpus_count_means_ranks_in_every_command(monkeypatch):
    """``--gpus N`` is N ranks in pool start/status/stop and encode --pool as in generate (GPUs
    0..N-1, or N CPU ranks without a GPU), so the same --gpus attaches to the same pool; indices
    need a comma. Found by a newcomer: pool start --gpus 2 meant GPU 2 while generate --gpus 2
    meant two ranks."""
    from ltx_mgpu.cli.pool import cli_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_gpus("2", None) == ("cpu", 2) and cli_gpus("2", 2) == ("cpu", 2)
    assert cli_gpus("0,1", None) == ("0,1", None) and cli_gpus("3,", None) == ("3,", None)
    assert cli_gpus("cpu", 3) == ("cpu", 3) and cli_gpus(None, None) == (None, None)
    with pytest.raises(ValueError, match="--gpus 0, for GPU 0 alone"):
        cli_gpus("0", None)
    with pytest.raises(ValueError, match="a bare --gpus is the rank count already"):
        cli_gpus("2", 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli_gpus("2", None) == ("0,1", None)


def test_gpus_torch_cannot_see_are_refused_before_anything_is_written(monkeypatch):
    """A pool asked for GPUs on a machine where torch sees none: one line naming the fix, and no
    runtime directory or lock left behind (found by a newcomer: run/gpu-0-1/ stayed)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    base = short_dir()
    try:
        with pytest.raises(ValueError, match="torch sees no CUDA GPU .* --gpus cpu --nproc N"):
            PoolClient.connect(gpus=[0, 1], runtime_dir=base)
        assert not any(base.iterdir())
    finally:
        cleanup(base)


# --------------------------------------------------------------------------- several starters at once


def test_an_encode_that_started_the_pool_hands_it_over_to_a_client_that_attached_meanwhile(base, tmp_path):
    """Issue 29, finding 8: two ``encode --pool`` on an empty runtime directory; the one that
    started the pool stopped it at its end, under the other's job. Now a client that would start
    a pool of its own attaches while the encode runs; the encode says it left the pool running for
    it, and the pool (the same pids) serves it on, then stops when it leaves."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"prompt number {i}" for i in range(64)) + "\n")
    env = {**ENV, "LTX_MGPU_HOME": str(tmp_path / "home")}
    encode = subprocess.Popen(
        [sys.executable, "-m", "ltx_mgpu", "encode", "--pool", "--gpus", "cpu", "--nproc", "1", "--embedded-gemma",
         "tiny", "--no-cache", "--batch-size", "1", "--prompts-file", str(prompts), "--no-progress",
         "--out", str(tmp_path / "emb.safetensors"), "--runtime-dir", str(base)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    d = base / "cpu-1"
    try:
        while launch.ping(d) is None:  # the encode's pool is up
            assert encode.poll() is None, encode.stderr.read()
            time.sleep(0.05)
        other = PoolClient.connect(gpus="cpu", nproc=1, runtime_dir=base, startup_timeout=120)
        assert not other.launched
        pids = pool_pids(other)
        out, err = encode.communicate(timeout=300)
        assert encode.returncode == 0, err
        assert (f"pool: pid {pids[0][0]}, 1 rank(s), placement single, started for this run; left running for "
                "another client that uses it") in out
        result, _ = other.request("selftest", {"steps": 2}, timeout=60)
        assert result["allreduce_ok"] and other.pid == pids[0][0] and len(running(pids)) == len(pids)
        assert other.status()["owner_left"].startswith("the client that started it")
        other.close()
        assert wait_all_gone(pids) == []
        assert launch.find_live_pool(d) is None
    finally:
        encode.kill()
        encode.wait()


def test_racing_detached_starts_make_one_pool_and_the_others_say_they_attached(base):
    """Issue 29, finding 9: four ``pool start --detach`` at once started a second pool in one
    round of two, and a starter exited 1 with torchrun's ChildFailedError. One pool, whatever the
    race: the losers wait for the launch lock, attach, and say so."""
    cmd = [sys.executable, "-m", "ltx_mgpu", "pool", "start", "--detach", "--gpus", "cpu", "--nproc", "1",
           "--runtime-dir", str(base)]
    starters = [subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in starters]
    assert [p.returncode for p in starters] == [0] * 4, outs
    info = rendezvous.PoolInfo.read(base / "cpu-1")
    assert info is not None and info.alive()
    started = [o for o, _ in outs if o.startswith(f"started pool pid {info.pid}:")]
    attached = [o for o, _ in outs if "a pool is already running" in o and f"pid {info.pid}," in o
                and "not started again" in o]
    assert len(started) == 1 and len(attached) == 3, outs
    assert not any("ChildFailedError" in o + e or "Traceback" in e for o, e in outs)
    torchruns = [p for p in psutil.process_iter(["cmdline"])
                 if "torch.distributed.run" in " ".join(p.info["cmdline"] or ()) and str(base) in
                 " ".join(p.info["cmdline"] or ())]
    assert [p.pid for p in torchruns] == [info.pid]


def test_generate_attaches_to_the_detached_pool_of_its_gpu_set_under_load(base):
    """Issue 29, finding 10: ``generate --gpus 2`` with a detached pool of the same GPU set
    running started its own (seen once at a load average of 10; the cause: a live pool's record
    could look dead after a step of the wall clock, ``tests/unit/test_rendezvous.py``). Here the
    pool generate asks for is attached, with every core kept busy, again and again."""
    from ltx_mgpu.cli.request import GenerateRequest, pool_spec_for

    out = _cli("start", "--detach", "--gpus", "2", "--runtime-dir", str(base))
    assert out.returncode == 0, out.stderr
    info = rendezvous.PoolInfo.read(base / "cpu-2")
    spec = pool_spec_for(GenerateRequest(prompt="x", gpus=2, runtime_dir=str(base)), 2, False)
    assert spec.dir == base / "cpu-2"
    with cpu_load():
        for _ in range(5):
            client = PoolClient(spec, startup_timeout=120)
            try:
                assert client.status(timeout=120)["pool"]["torchrun_pid"] == info.pid and not client.launched
            finally:
                client.release()  # not started here: left as it is
    assert info.alive() and launch.find_live_pool(base / "cpu-2") == info
