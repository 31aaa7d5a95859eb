"""One live 2-rank CPU pool (gloo) shared by the tests of this file: jobs, tensors, progress,
cancel, bad input, status, memory, shared-memory delivery, and hostile or broken clients that
must not hurt it."""

from __future__ import annotations

import os
import socket
import stat
import struct
import time

import psutil
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_support import raw_connect, raw_hello, read_answer

from ltx_mgpu import wire
from ltx_mgpu.client import launch
from ltx_mgpu.client.errors import BadInputError, JobCancelledError
from ltx_mgpu.client.pool_client import PoolClient
from ltx_mgpu.pool import engines
from ltx_mgpu.wire import arena, rendezvous
from ltx_mgpu.wire.receiver import ArenaReceiver


@pytest.fixture(scope="module")
def client(base):
    c = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, lifetime="with-owner", startup_timeout=120)
    yield c
    c.shutdown()


@pytest.fixture
def pool_dir(client):
    return client.dir


def _serving(client):
    result, tensors = client.request("selftest", {"steps": 1}, timeout=30)
    assert result["allreduce_ok"] and result["world_size"] == 2
    return result


def test_selftest_allreduce_and_tensor_round_trip(client):
    inputs = {"latent": torch.randn(2, 3, 4), "mask": torch.tensor([True, False]), "bf": torch.randn(5).bfloat16()}
    seen = []
    result, tensors = client.request("selftest", {"steps": 3, "echo": True, "numel": 16}, tensors=inputs,
                                     on_progress=lambda *p: seen.append(p), timeout=60)
    assert result["steps_done"] == 3 and result["allreduce_ok"] and result["control_ok"] and result["expected"] == 3.0
    assert seen == [("selftest", 1, 3), ("selftest", 2, 3), ("selftest", 3, 3)]
    assert torch.equal(tensors["allreduce"], torch.full((16,), 3.0))
    for k, v in inputs.items():
        assert tensors[k].dtype == v.dtype and torch.equal(tensors[k], v)


def test_a_job_result_carries_its_timeline_in_the_clients_clock(client):
    """Where a request's time went: the pool stamps arrival, start and finish, the client its
    send, the frame's arrival, its hand-over and the return, all on the host's monotonic clock."""
    t0 = time.monotonic()
    job = client.submit("selftest", {"steps": 1})
    result, _ = job.wait(timeout=60)
    t = result["timeline"]
    c = job.clock
    assert t0 <= c["sent"] <= t["received"] <= t["started"] <= t["finished"] <= c["arrived"] <= c["queued"] \
        <= c["returned"] <= time.monotonic()


def test_runtime_files_are_private(client, pool_dir):
    assert stat.S_IMODE(os.stat(pool_dir).st_mode) == 0o700
    for name in (rendezvous.SOCKET_NAME, rendezvous.TOKEN_NAME, rendezvous.INFO_NAME, rendezvous.LOG_NAME):
        assert stat.S_IMODE(os.stat(pool_dir / name).st_mode) == 0o600, name
    assert stat.S_ISSOCK(os.stat(pool_dir / rendezvous.SOCKET_NAME).st_mode)
    assert len(rendezvous.read_token(pool_dir)) == 64


def test_wrong_token_is_rejected_and_connection_closed(client, pool_dir):
    with raw_connect(pool_dir) as s:
        wire.send_frame(s, wire.make_request("hello", "h", {"token": "0" * 64}))
        answer = read_answer(s)
        assert answer["event"] == "error" and answer["kind"] == "bad_input" and "wrong token" in answer["message"]
        assert read_answer(s) is None
    with raw_connect(pool_dir) as s:  # anything before hello is refused too
        wire.send_frame(s, wire.make_request("status", "s"))
        answer = read_answer(s)
        assert answer["event"] == "error" and "first request must be 'hello'" in answer["message"]
        assert read_answer(s) is None
    _serving(client)


def test_unknown_type_closes_connection_but_schema_error_does_not(client, pool_dir):
    with raw_connect(pool_dir) as s:
        raw_hello(s, pool_dir)
        wire.send_frame(s, {"type": "selftest", "id": "p1", "params": {"steps": "three"}})
        answer = read_answer(s)
        assert answer["event"] == "error" and answer["id"] == "p1" and "selftest.steps must be int" in answer["message"]
        wire.send_frame(s, wire.make_request("status", "st"))
        assert read_answer(s)["event"] == "result"  # still open
        wire.send_frame(s, {"type": "bogus", "id": "b1", "params": {}})
        answer = read_answer(s)
        assert answer["event"] == "error" and "unknown request type 'bogus'" in answer["message"]
        assert read_answer(s) is None
    _serving(client)


def _prefix(hlen, plen, magic=wire.MAGIC, version=wire.PROTOCOL_VERSION):
    return struct.pack("!4sHHIQ", magic, version, 0, hlen, plen)


_hostile = st.one_of(
    st.binary(max_size=300),
    st.builds(lambda h, rest: _prefix(len(h), 0) + h + rest, st.binary(max_size=100), st.binary(max_size=20)),
    st.builds(lambda n, m: _prefix(n, m), st.integers(wire.MAX_HEADER_BYTES + 1, 2**32 - 1), st.integers(0, 2**64 - 1)),
    st.builds(lambda m: _prefix(2, m) + b"{}", st.integers(wire.DEFAULT_MAX_PAYLOAD_BYTES + 1, 2**64 - 1)),
    st.builds(lambda cut: wire.encode_header({"type": "selftest", "id": "t", "params": {"steps": 1}})[:cut],
              st.integers(0, 40)).map(lambda h: _prefix(60, 0) + h),
    st.builds(lambda v: _prefix(2, 0, version=v) + b"{}", st.integers(0, 65535).filter(lambda v: v != 1)),
)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=_hostile, authenticate=st.booleans())
def test_hostile_frames_get_an_error_or_a_close_and_the_pool_keeps_serving(client, pool_dir, data, authenticate):
    with raw_connect(pool_dir) as s:
        if authenticate:
            raw_hello(s, pool_dir)
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)  # a truncated frame ends here
        except OSError:
            pass  # the pool already refused and closed
        answer = read_answer(s)
        assert answer is None or (answer["event"] == "error" and answer["kind"] == "bad_input"), answer
    assert client.status()["pool"]["world_size"] == 2


_json = st.recursive(st.none() | st.booleans() | st.integers(-10, 10**12) | st.text(max_size=12),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
                     max_leaves=8)


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(mtype=st.sampled_from(["status", "cancel", "hello", "bogus", ""]) | st.text(max_size=10),
       rid=st.sampled_from(["ok-id", "", "bad id", None, 5]),
       params=st.dictionaries(st.text(max_size=8), _json, max_size=4),
       extra=st.booleans())
def test_malformed_messages_are_answered_with_an_error(client, pool_dir, mtype, rid, params, extra):
    header = {"type": mtype, "id": rid, "params": params, **({"junk": 1} if extra else {})}
    with raw_connect(pool_dir) as s:
        raw_hello(s, pool_dir)
        wire.send_frame(s, header)
        answer = wire.parse_event(read_answer(s))  # always a well-formed event, never silence
        well_formed = (mtype in ("status", "hello", "cancel") and rid == "ok-id" and not extra)
        assert answer["event"] == ("error" if not well_formed else answer["event"])
        if answer["event"] == "error":
            assert answer["kind"] == "bad_input" and answer["message"]


def test_hostile_clients_leave_the_pool_serving_jobs(client):
    _serving(client)


def test_bad_input_on_every_rank_keeps_the_pool_serving(client):
    with pytest.raises(BadInputError, match="steps must be >= 0"):
        client.request("selftest", {"steps": -1}, timeout=30)
    with pytest.raises(BadInputError, match="numel must be in"):
        client.request("selftest", {"steps": 1, "numel": 0}, timeout=30)
    _serving(client)


def test_job_type_without_engine_module_is_bad_input():
    schema = wire.register_request(wire.MessageSchema("x_missing_engine", ()))
    engines.ENGINE_MODULES["x_missing_engine"] = "ltx_mgpu.no_such_engine_module"
    try:
        with pytest.raises(engines.BadInput, match="not available in this build"):
            engines.resolve_engine("x_missing_engine")
    finally:
        wire.REQUESTS.pop(schema.name)
        engines.ENGINE_MODULES.pop(schema.name)


def test_model_store_replaces_describes_and_clears():
    store = engines.ModelStore()
    store.put("a", torch.nn.Linear(4, 2))
    assert store.describe()["a"]["bytes"] == (4 * 2 + 2) * 4 and store.describe()["a"]["type"] == "Linear"
    store.put("a", torch.zeros(3), info={"note": "x"})
    assert store.names() == ["a"] and store.describe()["a"] == {"type": "Tensor", "bytes": 12, "devices": ["cpu"],
                                                               "note": "x"}
    assert store.clear() == ["a"] and "a" not in store


def test_client_checks_schema_before_sending(client):
    with pytest.raises(BadInputError, match="selftest.steps must be int"):
        client.submit("selftest", {"steps": "x"})
    with pytest.raises(BadInputError, match="unknown request type"):
        client.submit("frobnicate", {})
    _serving(client)


def test_cancel_mid_job_stops_within_one_step_and_next_job_succeeds(client):
    job = client.submit("selftest", {"steps": 200, "step_seconds": 0.05})
    for ev in job.events(timeout=30):
        if ev["event"] == "progress" and ev["step"] >= 3:
            break
    answer = client.cancel(job.id)
    assert answer["found"] and answer["state"] == "running"
    with pytest.raises(JobCancelledError, match="cancelled"):
        job.wait(timeout=30)
    # after the pool took the cancel (at step k) the job reports at most one more step
    assert job.progress["step"] <= answer["progress"]["step"] + 1
    assert _serving(client)["steps_done"] == 1


def test_should_cancel_polling_and_queued_cancel(client):
    first = client.submit("selftest", {"steps": 200, "step_seconds": 0.05})
    queued = client.submit("selftest", {"steps": 1})
    assert client.cancel(queued.id)["state"] == "queued"
    with pytest.raises(JobCancelledError, match="while queued"):
        queued.wait(timeout=30)
    steps = []
    with pytest.raises(JobCancelledError):
        first.wait(timeout=60, poll_interval=0.02, on_progress=lambda ph, s, t: steps.append(s),
                   should_cancel=lambda: len(steps) >= 2)
    assert 2 <= first.progress["step"] < 200
    _serving(client)


def test_interrupt_raised_by_a_callback_cancels_the_job(client):
    class Interrupt(BaseException):  # ComfyUI's InterruptProcessingException is a BaseException
        pass

    def on_progress(phase, step, total):
        if step == 2:
            raise Interrupt()

    job = client.submit("selftest", {"steps": 200, "step_seconds": 0.05})
    with pytest.raises(Interrupt):
        job.wait(timeout=60, on_progress=on_progress)
    assert job.cancel_sent
    for _ in range(100):  # the pool drops the job at its next step boundary
        if client.status()["current"] is None:
            break
        time.sleep(0.05)
    assert client.status()["current"] is None
    _serving(client)


def test_status_while_a_job_runs(client):
    job = client.submit("selftest", {"steps": 100, "step_seconds": 0.05})
    for ev in job.events(timeout=30):
        if ev["event"] == "progress" and ev["step"] >= 2:
            break
    status = client.status()
    job.cancel()
    with pytest.raises(JobCancelledError):
        job.wait(timeout=30)
    assert status["current"]["id"] == job.id and status["current"]["progress"]["step"] >= 2
    assert [r["rank"] for r in status["ranks"]] == [0, 1]
    for r in status["ranks"]:
        assert r["device"] == "cpu" and r["memory"]["rss"] > 0 and r["memory"]["total"] > 0
        assert psutil.pid_exists(r["pid"])
    assert status["pool"]["torchrun_pid"] == client.pid


def test_resident_models_and_unload(client):
    client.request("selftest", {"steps": 0, "result_bytes": 1 << 20}, timeout=30)
    status = client.status()
    assert status["ranks"][0]["models"]["selftest.blob"]["bytes"] == 1 << 20
    result, _ = client.request("unload", {"names": None}, timeout=30)
    assert result["unloaded"] == ["selftest.blob"] and result["resident"] == []
    assert client.status()["ranks"][0]["models"] == {}


def test_ten_jobs_with_stable_memory(client):
    procs = [psutil.Process(r["pid"]) for r in client.pool["ranks"]]
    x = torch.randn(1 << 20)  # 4 MiB each way
    client.request("selftest", {"steps": 2, "echo": True}, tensors={"x": x}, timeout=30)  # warm up
    before = [p.memory_info().rss for p in procs]
    for _ in range(10):
        result, tensors = client.request("selftest", {"steps": 2, "echo": True}, tensors={"x": x}, timeout=30)
        assert result["allreduce_ok"] and torch.equal(tensors["x"], x)
    growth = [p.memory_info().rss - b for p, b in zip(procs, before)]
    # 10 jobs moved 80 MiB per rank; (inputs reach every rank, outputs rank 0); none of it may stay
    assert max(growth) < 24 << 20, growth


def test_disconnecting_client_cancels_its_running_job(client, base):
    other = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, start=False)
    assert other.pid == client.pid  # attached, not a second pool
    job = other.submit("selftest", {"steps": 100000, "step_seconds": 0.05})
    for ev in job.events(timeout=30):
        if ev["event"] == "progress":
            break
    other.close()
    # the pool cancels the orphaned job, so this one runs (it would wait ~80 min otherwise)
    assert client.request("selftest", {"steps": 1}, timeout=60)[0]["allreduce_ok"]


# --------------------------------------------------------------------------- shared-memory delivery

def _pattern(n: int) -> torch.Tensor:
    return torch.arange(251, dtype=torch.uint8).repeat(-(-n // 251))[:n]  # the selftest blob


def test_large_results_come_through_the_shared_arena_and_small_ones_through_the_socket(client):
    assert client.pool["features"] == [arena.FEATURE, arena.FEATURE_OWN] and client.shm_stats["enabled"]
    before = client.shm_stats["frames"]
    n = 3 << 20
    for _ in range(3):
        _, tensors = client.request("selftest", {"steps": 0, "result_bytes": n}, timeout=30)
        assert torch.equal(tensors["blob"], _pattern(n))
        tensors["blob"].zero_()  # the client's own memory: the next result is untouched
    _, small = client.request("selftest", {"steps": 0, "result_bytes": 1000}, timeout=30)
    assert torch.equal(small["blob"], _pattern(1000))
    stats = client.shm_stats
    assert stats["frames"] - before == 3 and stats["mapped"] and stats["bytes"] >= 3 * n
    client.request("unload", {"names": ["selftest.blob"]}, timeout=30)


def test_large_results_are_handed_over_once_the_pool_has_a_spare_and_stay_the_clients(client):
    """A result of at least OWN_MIN_BYTES goes into a spare the pool made in the background
    after the previous one, and the client's tensor is a view of that memory (no copy)."""
    n = arena.OWN_MIN_BYTES + (1 << 20)
    before = client.shm_stats["owned"]
    kept = []
    for _ in range(50):
        _, tensors = client.request("selftest", {"steps": 0, "result_bytes": n}, timeout=30)
        kept.append(tensors["blob"])
        if client.shm_stats["owned"] > before:
            break
        time.sleep(0.1)  # the spare is still being made
    assert client.shm_stats["owned"] > before
    kept[-1].zero_()  # the client's own memory
    _, again = client.request("selftest", {"steps": 0, "result_bytes": n}, timeout=30)
    assert torch.equal(again["blob"], _pattern(n)) and all(torch.equal(t, _pattern(n)) for t in kept[:-1])
    client.request("unload", {"names": ["selftest.blob"]}, timeout=30)


def test_a_client_without_shm_gets_the_same_results_over_the_socket(client, base):
    plain = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, start=False, shm=False)
    try:
        _, tensors = plain.request("selftest", {"steps": 0, "result_bytes": 3 << 20}, timeout=30)
        assert torch.equal(tensors["blob"], _pattern(3 << 20))
        assert plain.shm_stats == {"enabled": False, "frames": 0, "bytes": 0, "arenas": 0, "mapped": False,
                                   "owned": 0}
    finally:
        plain.close()
    with raw_connect(client.dir) as s:  # a client that never asks: plain frames, as before the feature
        assert raw_hello(s, client.dir)["features"] == [arena.FEATURE, arena.FEATURE_OWN]
        wire.send_frame(s, wire.make_request("selftest", "big", {"steps": 0, "result_bytes": 3 << 20}))
        s.settimeout(30)
        frames = [wire.recv_frame(s) for _ in range(2)]
        assert [h["event"] for h, _ in frames] == ["accepted", "result"]
        assert torch.equal(frames[1][1]["blob"], _pattern(3 << 20))
    client.request("unload", {"names": ["selftest.blob"]}, timeout=30)


def test_features_are_enabled_per_connection_and_unknown_ones_ignored(client):
    with raw_connect(client.dir) as s:
        raw_hello(s, client.dir)
        receiver = ArenaReceiver()
        assert launch.enable_features(s, ["warp-drive", arena.FEATURE], receiver) == [arena.FEATURE]
        wire.send_frame(s, wire.make_request("selftest", "big", {"steps": 0, "result_bytes": 2 << 20}))
        s.settimeout(30)
        _, tensors = [wire.recv_frame(s, shm=receiver) for _ in range(2)][1]
        assert torch.equal(tensors["blob"], _pattern(2 << 20)) and receiver.frames == 1
        receiver.drop()
    with raw_connect(client.dir) as s:
        raw_hello(s, client.dir)
        assert launch.enable_features(s, ["warp-drive"]) == []
    client.request("unload", {"names": ["selftest.blob"]}, timeout=30)


def test_a_client_sending_shared_memory_frames_is_refused_and_closed(client):
    with raw_connect(client.dir) as s:
        raw_hello(s, client.dir)
        launch.enable_features(s, [arena.FEATURE], ArenaReceiver())  # the pool -> client direction only
        raw = wire.encode_header({"type": "selftest", "id": "x", "params": {"steps": 0},
                                      "shm": {"arena": 1, "seq": 1, "offset": 64, "size": 100}})
        s.sendall(struct.pack("!4sHHIQ", wire.MAGIC, wire.PROTOCOL_VERSION, wire.FLAG_SHM, len(raw), 0)
                  + raw)
        answer = read_answer(s)
        assert answer["event"] == "error" and "flags 0x1 are not accepted here" in answer["message"]
        assert read_answer(s) is None
    _serving(client)


@pytest.mark.parametrize("result", [["not", "a", "dict"], "a string", 42])
def test_an_engine_result_that_is_not_a_dict_is_bad_input_and_the_pool_keeps_serving(tmp_path, result):
    """Server.finish() answers an engine's malformed result with bad_input instead of raising
    (a raise there ends the pool; found by review when the timeline was added)."""
    from ltx_mgpu.pool.server import Job, Server

    class Conn:
        shm = None

        def __init__(self):
            self.sent = []

        def send(self, header, payload=None):
            self.sent.append(header)

    server, conn = Server(tmp_path / "s.sock", "token", dict, list), Conn()
    job = Job(wire.Request("selftest", "a" * 32, {"steps": 0}, {}), conn)
    server.finish(job, result, None)
    assert conn.sent[-1]["event"] == "error" and conn.sent[-1]["kind"] == "bad_input" and job.done
    assert "cannot be sent" in conn.sent[-1]["message"]


def test_profile_jobs_writes_a_chrome_trace_per_rank_for_the_first_jobs_only(monkeypatch):
    """``LTX_MGPU_PROFILE_JOBS=1``: the first job of the pool is profiled on every rank into the
    runtime directory; the next one is not."""
    import json

    from pool_support import cleanup, short_dir

    base = short_dir()
    monkeypatch.setenv("LTX_MGPU_PROFILE_JOBS", "1")
    c = PoolClient.connect(gpus="cpu", nproc=2, runtime_dir=base, lifetime="with-owner", startup_timeout=120)
    try:
        job = c.submit("selftest", {"steps": 2})
        job.wait(timeout=60)
        c.request("selftest", {"steps": 1}, timeout=60)
        traces = sorted(c.dir.glob("profile-*.json"))
        assert [p.name for p in traces] == [f"profile-selftest-{job.id}-rank{r}.json" for r in (0, 1)]
        assert all(json.loads(p.read_text())["traceEvents"] for p in traces)
    finally:
        c.shutdown()
        cleanup(base)


def test_a_cancelled_model_load_is_waited_for_and_returns_while_a_stepped_job_is_killed_sooner(monkeypatch):
    """Stop during a load (no step boundary: reading 12B/19B weights takes minutes) must not make
    the client kill the pool after the 15 s meant for stepped jobs (found by a newcomer's read of
    the code): the load's result comes back as usual; a stepped job that ignores its cancel is
    killed after its own timeout."""
    import threading

    from ltx_mgpu.client import jobs

    class FakeClient:  # a jobs.JobOwner
        def __init__(self):
            self.sent, self.killed = [], []

        def send_cancel(self, job_id):
            self.sent.append("cancel")

        def kill(self, reason):
            self.killed.append(reason)

        def forget(self, rid):
            pass

        def mark_dead(self, reason, fatal=False):
            pass

        def with_log(self, message):
            return message

    assert jobs.cancel_timeout_for("load_transformer") >= 600 <= jobs.cancel_timeout_for(
        "load_text_encoder") and jobs.cancel_timeout_for("sample") == 15.0
    monkeypatch.setattr(jobs, "CANCEL_TIMEOUT_S", 0.2)
    monkeypatch.setattr(jobs, "LOAD_CANCEL_TIMEOUT_S", 30.0)
    fake = FakeClient()
    load = jobs.Job(fake, "a" * 32, "load_transformer")
    threading.Timer(0.6, lambda: load.deliver({"event": "result", "id": load.id, "result": {"ok": 1}}, {})).start()
    assert load.wait(should_cancel=lambda: True, poll_interval=0.02) == ({"ok": 1}, {})
    assert fake.sent == ["cancel"] and fake.killed == []  # 0.6 s after the cancel: still waited for
    stepped = jobs.Job(fake, "b" * 32, "sample")
    with pytest.raises(jobs.PoolFatalError, match="did not stop"):
        stepped.wait(should_cancel=lambda: True, poll_interval=0.02)
    assert len(fake.killed) == 1 and "sample job" in fake.killed[0]


def test_a_bad_profile_jobs_value_is_one_clear_error_before_anything_starts(monkeypatch):
    from pool_support import cleanup, short_dir

    from ltx_mgpu.settings import PROFILE_JOBS

    assert PROFILE_JOBS.get({}) == 0 and PROFILE_JOBS.get({"LTX_MGPU_PROFILE_JOBS": " 3 "}) == 3
    for bad in ("abc", "-1", "1.5"):
        with pytest.raises(ValueError, match=r"LTX_MGPU_PROFILE_JOBS='.*': give a whole number"):
            PROFILE_JOBS.get({"LTX_MGPU_PROFILE_JOBS": bad})
    base = short_dir()
    monkeypatch.setenv("LTX_MGPU_PROFILE_JOBS", "abc")
    try:
        with pytest.raises(ValueError, match="a whole number"):
            PoolClient.connect(gpus="cpu", nproc=1, runtime_dir=base, lifetime="with-owner", startup_timeout=60)
        assert not any(base.iterdir())  # no pool directory: nothing started
    finally:
        cleanup(base)
