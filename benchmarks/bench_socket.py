"""Socket benchmark: round trip of an empty job and throughput of a 100 MB result through the pool.

    python benchmarks/bench_socket.py                    # 2 CPU ranks in a temporary runtime dir
    python benchmarks/bench_socket.py --gpus 0 --mb 100  # a GPU pool

Prints one table, each number measured in this run:

* round trip of ``status`` (answered by rank 0's socket thread) and of a ``selftest`` job with
  0 steps (queue, control broadcast to every rank, outcome all-gather, result); median over
  ``--repeat`` calls. Goal: <= 5 ms.
* throughput of a ``--mb`` MB uint8 result (``selftest`` ``result_bytes``, resident in the pool
  so only the transfer is timed): request -> tensors in this process (received with
  ``recv_into`` into one buffer, parsed in place by ``ltx_mgpu.payload``). Goal: >= 1 GB/s.
  Beside it: the same frame over an in-process socket pair (no pool); the same frame received
  the way ``safetensors.torch.load`` needs it (one ``bytes``, then the library's copy), for
  reference; and a local memcpy of the same size into a fresh buffer (page faults included,
  like the receive path) and into a reused, already-touched buffer.

GB/s are 10^9 bytes per second.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load as st_load

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ltx_mgpu import protocol  # noqa: E402
from ltx_mgpu.client import PoolClient  # noqa: E402


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _best_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _recv_with_library(sock: socket.socket) -> dict:
    """One frame received as ``bytes`` and parsed by ``safetensors.torch.load`` (which copies):
    the receive path before ``ltx_mgpu.payload``, kept here as the reference."""
    prefix = sock.recv(protocol.PREFIX_SIZE, socket.MSG_WAITALL)
    _, _, _, header_len, payload_len = struct.unpack("!4sHHIQ", prefix)
    sock.recv(header_len, socket.MSG_WAITALL)
    data = sock.recv(payload_len, socket.MSG_WAITALL)
    assert len(data) == payload_len
    return st_load(data)


def _socketpair_seconds(t: torch.Tensor, repeat: int, receive=protocol.recv_frame) -> float:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def once():
        payload = protocol.tensors_to_payload({"blob": t})
        sender = threading.Thread(target=protocol.send_frame, args=(a, {"event": "x"}, payload))
        sender.start()
        out = receive(b)
        tensors = out[1] if isinstance(out, tuple) else out
        sender.join()
        assert tensors["blob"].numel() == t.numel()

    try:
        once()
        return _best_s(once, repeat)
    finally:
        a.close()
        b.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default="cpu", help="'cpu' (default), 'all' or indices like 0,1")
    p.add_argument("--nproc", type=int, default=2, help="CPU ranks (default 2; ignored for GPUs)")
    p.add_argument("--runtime-dir", default=None, help="default: a temporary directory, removed at the end")
    p.add_argument("--mb", type=float, default=100.0, help="result size in MB (10^6 bytes), default 100")
    p.add_argument("--repeat", type=int, default=10, help="timed repetitions of the transfer (default 10)")
    p.add_argument("--rt-repeat", type=int, default=200, help="timed round trips (default 200)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tmp = None if args.runtime_dir else tempfile.mkdtemp(prefix="lm-bench-", dir="/tmp")
    nproc = None if args.gpus != "cpu" else args.nproc
    nbytes = int(args.mb * 1e6)
    t0 = time.perf_counter()
    client = PoolClient.connect(gpus=args.gpus, nproc=nproc, runtime_dir=args.runtime_dir or tmp)
    start_s = time.perf_counter() - t0
    try:
        pool = client.pool
        for _ in range(20):  # warm up
            client.status()
            client.request("selftest", {"steps": 0})
        rt_status = _median_ms(client.status, args.rt_repeat)
        rt_job = _median_ms(lambda: client.request("selftest", {"steps": 0}), args.rt_repeat)

        def transfer():
            result, tensors = client.request("selftest", {"steps": 0, "result_bytes": nbytes})
            assert tensors["blob"].numel() == nbytes

        transfer()  # builds the resident blob
        pool_s = _best_s(transfer, args.repeat)
        blob = torch.arange(251, dtype=torch.uint8).repeat(nbytes // 251 + 1)[:nbytes].clone()
        pair_s = _socketpair_seconds(blob, args.repeat)
        library_s = _socketpair_seconds(blob, args.repeat, _recv_with_library)
        fresh_s = _best_s(lambda: torch.empty_like(blob).copy_(blob), args.repeat)
        dst = torch.empty_like(blob)
        dst.copy_(blob)
        warm_s = _best_s(lambda: dst.copy_(blob), args.repeat)
        client.request("unload", {"names": ["selftest.blob"]})
    finally:
        client.shutdown()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    gbs = lambda s: nbytes / s / 1e9  # noqa: E731
    rows = [
        ("pool start (torchrun + ranks + hello)", f"{start_s:8.2f} s", ""),
        ("round trip: status (median)", f"{rt_status:8.2f} ms", "<= 5 ms"),
        ("round trip: selftest, 0 steps (median)", f"{rt_job:8.2f} ms", "<= 5 ms"),
        (f"{args.mb:.0f} MB result through the pool", f"{gbs(pool_s):8.2f} GB/s", ">= 1 GB/s"),
        (f"{args.mb:.0f} MB frame, in-process socket pair", f"{gbs(pair_s):8.2f} GB/s", ""),
        ("  same, bytes + safetensors.torch.load", f"{gbs(library_s):8.2f} GB/s", ""),
        (f"{args.mb:.0f} MB memcpy into a fresh buffer", f"{gbs(fresh_s):8.2f} GB/s", ""),
        (f"{args.mb:.0f} MB memcpy into a reused buffer", f"{gbs(warm_s):8.2f} GB/s", ""),
        ("pool / fresh memcpy", f"{fresh_s / pool_s:8.2f} x", ""),
    ]
    print(f"pool: {pool['world_size']} rank(s) on {pool['device']}, ltx_mgpu {pool['version']}, "
          f"torch {torch.__version__}")
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':>13}  goal")
    for name, value, goal in rows:
        print(f"{name:<{width}}  {value:>13}  {goal}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
