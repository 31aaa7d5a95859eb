"""Hostile and careless peers against the client and the pool's socket server, fast: the pool here is
``tests/fake_pool.py`` (the real rank-0 server and runtime files, a stub job loop). What is
covered, each against a pool that must afterwards answer ``status`` with the same pids:

* a client that cannot connect (backlog or slots full) retries and reports the pool busy; it
  never stops a pool it cannot prove dead;
* the handshake is bounded in all (a client trickling bytes is cut off) and tokenless
  connections cannot take the slots of authenticated ones; a header declaring gigabytes costs
  nothing until they arrive; a frame the server cannot decode gets an ``error`` event;
* the runtime directory and ``pool.json`` are trusted no further than they deserve: links,
  other users' or world-writable directories are refused, a socket served by another user's or
  an unrelated process is refused, a forged ``pool.json`` never gets a process signalled;
* a client left open at interpreter exit is closed first (its reader thread ended).

Tests that need a second user run only as root (they ``setuid`` a child); the reason is given
when they skip.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from pool_support import cleanup, raw_connect, raw_hello, read_answer, short_dir

from ltx_mgpu import wire
from ltx_mgpu.client import launch, pool_client
from ltx_mgpu.client.errors import PoolBusyError, PoolError
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.wire import rendezvous

FAKE = Path(__file__).resolve().parents[1] / "fake_pool.py"
HERE = Path(__file__).resolve().parent  # this file, which the child scripts import
NOBODY = 65534
ROOT = os.getuid() == 0


def fake_command(spec, port, owner):
    cmd = [sys.executable, str(FAKE), "--runtime-dir", str(spec.dir), "--ranks", str(spec.nproc),
           "--lifetime", spec.lifetime]
    if owner is not None:
        cmd += ["--owner-pid", str(owner[0]), "--owner-create-time", repr(owner[1])]
    return cmd


@pytest.fixture()
def rt(monkeypatch):
    monkeypatch.setattr(launch, "torchrun_command", fake_command)
    monkeypatch.setenv("LTX_MGPU_HELLO_TIMEOUT", "1")  # read by the pools started here
    base = short_dir()
    yield base
    cleanup(base)


def connect(base: Path, **kw) -> PoolClient:
    return PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, lifetime="detached", startup_timeout=30, **kw)


def pids_of(client: PoolClient) -> list[int]:
    return [client.pool["torchrun_pid"]] + [r["pid"] for r in client.pool["ranks"]]


# --------------------------------------------------------------------------- connecting


def test_a_client_that_cannot_connect_reports_the_pool_busy_and_never_stops_it(rt, monkeypatch):
    """Every handshake slot held by tokenless connections: a new client retries, then says the
    pool is busy; the pool (same pids) serves its old client on, and the new one once the
    squatters are cut off (after the 1 s handshake limit)."""
    a = connect(rt)
    try:
        before = pids_of(a)
        squatters = [raw_connect(a.dir) for _ in range(64)]
        time.sleep(0.2)
        monkeypatch.setattr(pool_client, "ATTACH_TIMEOUT_S", 0.5)
        with pytest.raises(PoolBusyError, match="runs but did not take this connection"):
            connect(rt)
        assert a.status()["pool"]["torchrun_pid"] == before[0]  # authenticated clients keep their slot
        monkeypatch.setattr(pool_client, "ATTACH_TIMEOUT_S", 10.0)
        b = connect(rt)  # the squatters are cut off within the handshake limit
        assert not b.launched and pids_of(b) == before
        b.close()
        for s in squatters:
            s.close()
    finally:
        a.shutdown()


def test_a_burst_of_clients_attaches_to_one_pool(rt):
    first = connect(rt)
    try:
        results, errors = [], []

        def attach():
            try:
                c = connect(rt)
                results.append(c.pid)
                c.close()
            except Exception as e:  # noqa: BLE001 - collected for the assertion
                errors.append(repr(e))

        threads = [threading.Thread(target=attach) for _ in range(48)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and results == [first.pid] * 48
    finally:
        first.shutdown()


# --------------------------------------------------------------------------- the handshake and frames


def _hello_frame(token: str) -> bytes:
    header = wire.encode_header(wire.make_request("hello", "h1", {"token": token}))
    return struct.pack("!4sHHIQ", wire.MAGIC, wire.PROTOCOL_VERSION, 0, len(header), 0) + header


def test_the_whole_handshake_is_bounded_not_each_read(rt):
    """One byte every 0.3 s keeps each read under its timeout; the connection is still cut once
    the handshake's limit (1 s here) has passed, and the pool serves on."""
    client = connect(rt)
    try:
        frame = _hello_frame(rendezvous.read_token(client.dir))
        s = raw_connect(client.dir)
        t0, cut = time.monotonic(), False
        for i in range(len(frame) - 1):
            try:
                s.sendall(frame[i:i + 1])
            except OSError:
                cut = True
                break
            time.sleep(0.3)
            if time.monotonic() - t0 > 5:
                break
        if not cut:  # the pool stopped reading: the next read sees the end (or the error event)
            answer = read_answer(s, timeout=5)
            cut = answer is None or answer.get("event") == "error"
        assert cut and time.monotonic() - t0 < 5
        s.close()
        assert client.status()["pool"]["torchrun_pid"] == client.pid
    finally:
        client.shutdown()


def test_a_header_declaring_gigabytes_allocates_nothing_before_they_arrive(rt):
    client = connect(rt)
    try:
        rank0 = psutil.Process(client.pool["torchrun_pid"])
        rss = rank0.memory_info().rss
        s = raw_connect(client.dir)
        raw_hello(s, client.dir)
        header = wire.encode_header(wire.make_request("selftest", "big", {"steps": 1}))
        s.sendall(struct.pack("!4sHHIQ", wire.MAGIC, wire.PROTOCOL_VERSION, 0, len(header), 4 << 30) + header)
        time.sleep(1.0)
        assert rank0.memory_info().rss - rss < 64 << 20
        s.close()
        assert client.status()["pool"]["torchrun_pid"] == client.pid
    finally:
        client.shutdown()


def test_a_frame_the_server_cannot_decode_gets_an_error_event(rt):
    """A payload whose shape's strides would overflow (an empty tensor of 2^62 x 4 elements)."""
    client = connect(rt)
    try:
        s = raw_connect(client.dir)
        raw_hello(s, client.dir)
        meta = b'{"t":{"dtype":"F32","shape":[4611686018427387904,4,0],"data_offsets":[0,0]}}'
        payload = struct.pack("<Q", len(meta)) + meta
        header = wire.encode_header(wire.make_request("selftest", "bad", {"steps": 1}))
        s.sendall(struct.pack("!4sHHIQ", wire.MAGIC, wire.PROTOCOL_VERSION, 0, len(header), len(payload))
                  + header + payload)
        answer = read_answer(s)
        assert answer is not None and answer["event"] == "error" and "strides" in answer["message"]
        s.close()
        assert client.status()["pool"]["torchrun_pid"] == client.pid
    finally:
        client.shutdown()


# --------------------------------------------------------------------------- the runtime directory


def test_a_runtime_directory_that_is_a_link_is_refused_and_its_target_untouched(rt, tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    (target / "keep.txt").write_text("mine")
    (rt / "cpu-2").symlink_to(target)
    with pytest.raises(PermissionError, match="is a symbolic link"):
        connect(rt)
    assert (target / "keep.txt").read_text() == "mine" and target.stat().st_mode & 0o777 == 0o755
    assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]


def test_a_base_directory_writable_by_others_is_refused(rt):
    os.chmod(rt, 0o777)
    with pytest.raises(PermissionError, match="writable by others"):
        connect(rt)


@pytest.mark.skipif(not ROOT, reason="needs root to make a directory another user's (chown)")
def test_a_runtime_directory_of_another_user_is_refused(rt):
    d = rt / "cpu-2"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(PermissionError, match=f"belongs to uid {NOBODY}"):
        connect(rt)


def test_a_forged_pool_json_never_gets_an_unrelated_process_signalled(rt):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        d = rendezvous.ensure_private_dir(rt / "cpu-2")
        info = rendezvous.PoolInfo(pid=victim.pid, create_time=psutil.Process(victim.pid).create_time(), gpus=[],
                                nproc=2, device="cpu", version="0", protocol=wire.PROTOCOL_VERSION,
                                start_time=time.time(), lifetime="detached", owner_pid=None, master_port=1,
                                instance="forged", dir=str(d))
        info.write()
        rendezvous.write_private(d / rendezvous.TOKEN_NAME, b"forged")
        assert launch.pool_processes(d) == []
        launch.stop(d)
        with pytest.raises(PoolError):
            PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=rt, start=False)
        time.sleep(0.3)
        assert victim.poll() is None  # never signalled
    finally:
        victim.kill()
        victim.wait()


def _impostor(sock_path: Path, uid: int | None) -> subprocess.Popen:
    """A process listening on ``sock_path`` (as ``uid`` when given) that answers nothing."""
    code = textwrap.dedent(f"""
        import os, socket, sys, time
        uid = {uid!r}
        if uid is not None:
            os.setgid(uid); os.setuid(uid)
        s = socket.socket(socket.AF_UNIX); s.bind({str(sock_path)!r}); s.listen(8)
        print("ready", flush=True)
        while True:
            c, _ = s.accept()
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def test_a_socket_served_by_a_process_that_is_not_the_pool_is_refused(rt, tmp_path):
    """Same user, but not a descendant of the torchrun that pool.json records: the client sends
    nothing to it (not even the token)."""
    client = connect(rt)
    try:
        d = client.dir
        spot = tmp_path / "imp.sock"
        imp = _impostor(spot, None)
        try:
            os.replace(spot, d / rendezvous.SOCKET_NAME)
            with pytest.raises(PoolError, match="which is not the pool recorded"):
                launch.open_socket(d)
            assert launch.ping(d) is None
        finally:
            imp.kill()
            imp.wait()
    finally:
        launch.stop(client.dir, graceful=False)
        client.close()


@pytest.mark.skipif(not ROOT, reason="needs root to run the impostor as another user (setuid)")
def test_a_socket_served_by_another_user_is_refused(rt):
    client = connect(rt)
    box = short_dir()  # under /tmp: the other user must reach it
    try:
        os.chmod(box, 0o777)
        imp = _impostor(box / "imp.sock", NOBODY)
        try:
            os.replace(box / "imp.sock", client.dir / rendezvous.SOCKET_NAME)
            with pytest.raises(PoolError, match=f"served by uid {NOBODY}, not by you"):
                launch.open_socket(client.dir)
        finally:
            imp.kill()
            imp.wait()
    finally:
        launch.stop(client.dir, graceful=False)
        client.close()
        cleanup(box)


@pytest.mark.skipif(not ROOT, reason="needs root to connect as another user (setuid)")
def test_the_pool_refuses_connections_from_another_user(rt):
    """The socket is 0600 in a 0700 directory; with both opened up, the server still refuses a
    peer of another uid (SO_PEERCRED), before any token is read."""
    client = connect(rt)
    try:
        d = client.dir
        os.chmod(rt, 0o711)
        os.chmod(d, 0o711)
        os.chmod(d / rendezvous.SOCKET_NAME, 0o666)
        code = textwrap.dedent(f"""
            import os, socket, sys
            sys.path[:0] = [{str(FAKE.parent.parent)!r}]
            from ltx_mgpu import wire  # before dropping to the other user, who cannot read this tree
            os.setgid({NOBODY}); os.setuid({NOBODY})
            s = socket.socket(socket.AF_UNIX); s.connect({str(d / rendezvous.SOCKET_NAME)!r})
            wire.send_frame(s, wire.make_request("hello", "h", {{"token": "x"}}))
            print(wire.recv_frame(s)[0])
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert "connections from uid" in out.stdout, out.stdout + out.stderr
        os.chmod(d, 0o700)
        os.chmod(rt, 0o700)
        assert client.status()["pool"]["torchrun_pid"] == client.pid
    finally:
        client.shutdown()


# --------------------------------------------------------------------------- clean exits


def test_a_client_left_open_is_closed_at_exit_before_its_reader_could_be_frozen(rt):
    script = textwrap.dedent(f"""
        import atexit, sys, threading
        sys.path[:0] = [{str(HERE)!r}, {str(FAKE.parent)!r}, {str(FAKE.parent.parent)!r}]
        def check():  # registered first, so it runs after the client's own atexit hook
            alive = [t.name for t in threading.enumerate() if t.name == "ltx_mgpu-pool-reader"]
            print("readers at exit:", len(alive), flush=True)
        atexit.register(check)
        from ltx_mgpu.client import launch
        from ltx_mgpu.client.pool_client import PoolClient
        from test_hostile_client import fake_command
        launch.torchrun_command = fake_command
        c = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir={str(rt)!r}, lifetime="detached",
                               startup_timeout=30)
        c.request("selftest", {{"steps": 1}}, timeout=10)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "readers at exit: 0" in out.stdout, out.stdout + out.stderr


def test_close_waits_for_the_reader_thread(rt):
    client = connect(rt)
    reader = client._reader
    assert reader is not None and reader.is_alive()
    client.close()
    assert not reader.is_alive()
    launch.stop(client.dir)
