"""``JobContext.agree``: a failure some ranks saw becomes the same BadInput on every rank.

Three real gloo ranks run as ``python tests/integration/test_agree.py <dir> <rank>`` subprocesses (no
pool, no pickling); each writes what every agreement raised on it as JSON. The pool-level
behaviour (bad_input reaches the client, the pool keeps serving) is in test_text_pool.py and
test_denoise_pool.py.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

WORLD = 3
#: (name, what each rank passes: None | "msg:<text>" | "exc:<text>", the ``what`` argument)
CASES = [
    ("all_well", [None, None, None], None),
    ("one_exception", [None, "exc:weights truncated", None], "loading the text encoder"),
    ("two_messages", [None, "msg:first", "msg:second"], None),
    ("exception_without_what", ["exc:no memory", None, None], None),
]


def _rank_main(out_dir: str, rank: int) -> None:
    import torch
    import torch.distributed as dist

    from ltx_mgpu.pool.engines import BadInput, JobContext, ModelStore

    # a file store: no rendezvous port to race for
    dist.init_process_group("gloo", init_method=f"file://{Path(out_dir) / 'store'}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    ctx = JobContext(rank, WORLD, 0, torch.device("cpu"), dist.group.WORLD, dist.group.WORLD, ModelStore(), "j", "t")
    report = {}
    for name, errors, what in CASES:
        mine = errors[rank]
        if mine is not None:
            kind, text = mine.split(":", 1)
            try:
                if kind == "exc":
                    raise RuntimeError(text)
                mine = text
            except RuntimeError as e:  # raised, so it carries a traceback like a real failure
                mine = e
        try:
            ctx.agree(mine, what)
            report[name] = None
        except BadInput as e:
            report[name] = str(e)
    try:
        ctx.agree(42)  # refused locally, before the collective: no rank waits
        report["type_error"] = None
    except TypeError as e:
        report["type_error"] = str(e)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()  # nobody tears the group down while a peer still talks to it
    dist.destroy_process_group()


def test_every_rank_raises_the_first_failing_ranks_message(tmp_path):
    from rank_support import run_rank_processes

    logs = run_rank_processes(__file__, str(tmp_path), WORLD, timeout=120)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert all(rep == reports[0] for rep in reports), reports  # identical on every rank
    assert reports[0] == {
        "all_well": None,
        "one_exception": "loading the text encoder failed: weights truncated (RuntimeError) (on rank 1)",
        "two_messages": "first (on rank 1 and 1 more)",
        "exception_without_what": "no memory (RuntimeError) (on rank 0)",
        "type_error": "agree() takes an exception, a message or None, not int",
    }
    assert "Traceback" in logs[1] and "weights truncated" in logs[1]  # the full story goes to the rank's log


if __name__ == "__main__":
    _rank_main(sys.argv[1], int(sys.argv[2]))
    # Skip interpreter finalisation: gloo's background threads can abort the process in static
    # destructors after the group is destroyed ("terminate called without an active exception",
    # seen about 1 run in 10 under load). The report is already on disk; the pool's worker
    # exits the same way.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
