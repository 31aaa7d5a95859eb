"""Socket benchmark: round trips, and how fast a large result gets from the pool into this process.

    python benchmarks/bench_socket.py                       # 2 CPU ranks, 12.5 and 100 MB results
    python benchmarks/bench_socket.py --nproc 1 --mb 12.5   # one rank, one size
    python benchmarks/bench_socket.py --gpus 0              # a GPU pool

Prints one table, each number measured in this run (medians over ``--repeat``):

* round trip of ``status`` (answered by rank 0's socket thread) and of a ``selftest`` job with
  0 steps (queue, control broadcast to every rank, outcome all-gather, result); median over
  ``--rt-repeat`` calls. Goal: <= 5 ms.
* for each ``--mb`` size, a uint8 result (``selftest`` ``result_bytes``, resident in the pool,
  so only the delivery is timed: request -> tensors in this process) to a client taking it
  through the socket (``shm=False``: received with ``recv_into`` into one buffer, parsed in
  place) and to one taking it through the shared-memory arena (``ltx_mgpu.wire.arena``: the pool
  copies it into the warm arena, the client copies it out); then the same bytes read as a
  bf16 embedding and delivered as float32, the way ``encode`` results arrive (socket: upcast
  after receipt; arena: ``receive`` upcasts straight from the arena). Beside them, in this
  process: the frame over a socket pair, the arena over a socket pair, a tmpfs file per
  payload (the design not taken: write, map, copy out, unlink), and a memcpy into a fresh
  and into a reused buffer; the pool side's float32 -> bf16 conversion of the same embedding
  and the client's upcast of a received one;
  and the payload shaped like an ``encode`` result (k prompts ``[1024, 6144]`` bf16, float32
  in hand at the end) over a socket pair and over the arena. Timings follow 5 untimed rounds
  (the first rounds pay page faults on fresh memory; glibc then reuses freed blocks < 32 MB).

GB/s are 10^9 bytes per second (of the payload as sent).
"""

from __future__ import annotations

import argparse
import mmap
import os
import secrets
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ltx_mgpu import wire
from ltx_mgpu.client.pool_client import PoolClient  # noqa: E402
from ltx_mgpu.wire.arena import Budget  # noqa: E402
from ltx_mgpu.wire.receiver import ArenaReceiver  # noqa: E402
from ltx_mgpu.wire.sender import ArenaSender  # noqa: E402

EMBEDDING_BYTES = 1024 * 6144 * 2  # one 1024-token LTX-2.3 embedding in bf16


def _median_s(fn, repeat: int, warmup: int = 5) -> float:
    for _ in range(warmup):  # steady state: glibc reuses freed blocks < 32 MB after a few rounds
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _upcast(name: str, t: torch.Tensor) -> torch.Tensor:
    """What ``ltx_mgpu.client.text.upcast`` does to a received bf16 embedding."""
    return torch.empty(t.shape, dtype=torch.float32).copy_(t)


def _pair_seconds(tensors: dict, repeat: int, arena: bool, upcast: bool = False) -> float:
    """One frame of ``tensors`` over an in-process socket pair, through the socket or the arena;
    ``upcast``: float32 copies in hand at the end (arena: straight from it, as ``encode``)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender = ArenaSender(Budget(), min_bytes=0) if arena else None
    receiver = ArenaReceiver(take=(lambda header: _upcast) if upcast else None) if arena else None

    def once():
        payload = wire.tensors_to_payload(tensors)
        th = threading.Thread(target=wire.send_frame, args=(a, {"event": "x"}, payload), kwargs={"shm": sender})
        th.start()
        _, got = wire.recv_frame(b, shm=receiver)
        th.join()
        if upcast and not arena:
            got = {k: _upcast(k, v) for k, v in got.items()}
        assert all(v.dtype == (torch.float32 if upcast else tensors[k].dtype) for k, v in got.items())
        assert len(got) == len(tensors)

    try:
        return _median_s(once, repeat)
    finally:
        if arena:
            sender.close()
            receiver.drop()
        a.close()
        b.close()


def _tmpfs_file_seconds(t: torch.Tensor, repeat: int) -> float | None:
    """A fresh tmpfs file per payload: write it (O_EXCL, 0600), open, map (populated), copy
    out, unmap, unlink. None without /dev/shm."""
    if not os.path.isdir("/dev/shm"):
        return None
    d = tempfile.mkdtemp(prefix="lm-bench-", dir="/dev/shm")
    src = memoryview(t.numpy()).cast("B")
    n = src.nbytes

    def once():
        path = os.path.join(d, secrets.token_hex(16))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        off = 0
        while off < n:
            off += os.write(fd, src[off:])
        os.close(fd)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        os.unlink(path)
        mm = mmap.mmap(fd, n, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
        os.close(fd)
        with memoryview(mm) as view:
            out = bytearray(view)
        mm.close()
        assert len(out) == n

    try:
        return _median_s(once, repeat)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _delivery_rows(label: str, nbytes: int, clients: dict, repeat: int) -> list[tuple[str, float]]:
    """Seconds of each pool -> client delivery of an ``nbytes`` result."""
    rows = []
    for way, client in clients.items():
        def raw():
            _, tensors = client.request("selftest", {"steps": 0, "result_bytes": nbytes})
            assert tensors["blob"].numel() == nbytes

        rows.append((f"{label} result, pool -> client, {way}", _median_s(raw, repeat)))
    for way, client in clients.items():
        def as_embedding():  # the bytes as a bf16 embedding, float32 in hand at the end
            if way == "socket":
                _, tensors = client.request("selftest", {"steps": 0, "result_bytes": nbytes})
                out = _upcast("blob", tensors["blob"].view(torch.bfloat16))
            else:
                _, tensors = client.request("selftest", {"steps": 0, "result_bytes": nbytes},
                                            receive=lambda name, t: _upcast(name, t.view(torch.bfloat16)))
                out = tensors["blob"]
            assert out.dtype == torch.float32 and out.numel() == nbytes // 2

        rows.append((f"  as bf16 -> float32 in hand, {way}", _median_s(as_embedding, repeat)))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default="cpu", help="'cpu' (default), 'all' or indices like 0,1")
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks (default 2; ignored for GPUs)")
    p.add_argument("--runtime-dir", default=None, help="default: a temporary directory, removed at the end")
    p.add_argument("--mb", type=float, nargs="+", default=[12.5, 100.0],
                   help="result sizes in MB (10^6 bytes), default 12.5 100 (one 1024-token LTX-2.3 embedding "
                        "in bf16; eight)")
    p.add_argument("--repeat", type=int, default=10, help="timed repetitions of each transfer (default 10)")
    p.add_argument("--rt-repeat", type=int, default=200, help="timed round trips (default 200)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tmp = None if args.runtime_dir else tempfile.mkdtemp(prefix="lm-bench-", dir="/tmp")
    nproc = None if args.gpus != "cpu" else args.nproc
    where = dict(gpus=args.gpus, nproc=nproc, runtime_dir=args.runtime_dir or tmp)
    t0 = time.perf_counter()
    client = PoolClient.connect(**where, shm=False)
    start_s = time.perf_counter() - t0
    rows: list[tuple[str, str, str]] = [("pool start (torchrun + ranks + hello)", f"{start_s:8.2f} s", "")]
    fast = None
    try:
        pool = client.pool
        fast = PoolClient.connect(**where, start=False, shm=True)
        clients = {"socket": client}
        if fast.shm_stats["enabled"]:
            clients["shm arena"] = fast
        for _ in range(20):  # warm up
            client.status()
            client.request("selftest", {"steps": 0})
        rt_status = _median_s(client.status, args.rt_repeat) * 1e3
        rt_job = _median_s(lambda: client.request("selftest", {"steps": 0}), args.rt_repeat) * 1e3
        rows += [("round trip: status (median)", f"{rt_status:8.2f} ms", "<= 5 ms"),
                 ("round trip: selftest, 0 steps (median)", f"{rt_job:8.2f} ms", "<= 5 ms")]
        for mb in args.mb:
            nbytes = int(mb * 1e6) // 2 * 2
            label = f"{mb:g} MB"
            timed = _delivery_rows(label, nbytes, clients, args.repeat)
            blob = torch.arange(251, dtype=torch.uint8).repeat(nbytes // 251 + 1)[:nbytes].clone()
            timed.append((f"{label} frame, in-process socket pair", _pair_seconds({"blob": blob}, args.repeat, False)))
            timed.append((f"{label} frame, in-process arena", _pair_seconds({"blob": blob}, args.repeat, True)))
            k = max(1, round(nbytes / EMBEDDING_BYTES))  # encode-shaped: k prompts [1024, 6144] bf16
            prompts = {f"prompt_{i}": torch.randn(1024, 6144).bfloat16() for i in range(k)}
            for way, arena in (("socket pair", False), ("arena", True)):
                timed.append((f"  {k} x [1024, 6144] bf16 -> float32 in hand, {way}",
                              _pair_seconds(prompts, args.repeat, arena, upcast=True)))
            tmpfs = _tmpfs_file_seconds(blob, args.repeat)
            if tmpfs is not None:
                timed.append((f"{label}, a tmpfs file per payload (not used)", tmpfs))
            timed.append((f"{label} memcpy into a fresh buffer", _median_s(lambda: torch.empty_like(blob).copy_(blob),
                                                                            args.repeat)))
            dst = blob.clone()
            timed.append((f"{label} memcpy into a reused buffer", _median_s(lambda: dst.copy_(blob), args.repeat)))
            f32 = torch.randn(nbytes // 2)
            bf16 = f32.bfloat16()
            timed.append((f"{label} bf16 from float32 rows (pool side)",
                          _median_s(lambda: torch.empty(f32.shape, dtype=torch.bfloat16).copy_(f32), args.repeat)))
            timed.append((f"{label} float32 from bf16 (client side, socket)",
                          _median_s(lambda: torch.empty(bf16.shape, dtype=torch.float32).copy_(bf16), args.repeat)))
            for name, s in timed:
                rows.append((name, f"{s * 1e3:8.2f} ms", f"{nbytes / s / 1e9:6.2f} GB/s"))
            client.request("unload", {"names": ["selftest.blob"]})
        shm_note = f"shm arena {'on' if 'shm arena' in clients else 'not offered'}"
    finally:
        if fast is not None:
            fast.close()
        client.shutdown()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"pool: {pool['world_size']} rank(s) on {pool['device']}, ltx_mgpu {pool['version']}, "
          f"torch {torch.__version__}, {shm_note}")
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':>11}  rate / goal")
    for name, value, extra in rows:
        print(f"{name:<{width}}  {value:>11}  {extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
