"""A pool's private files and process records (``ltx_mgpu.wire.rendezvous``), and the CLI's
checks of GPUs and paths (``ltx_mgpu.cli.checks``), in one process: identities that a wall-clock
step cannot break, a ``pool.json`` trusted no further than it deserves, nothing made inside a
link, and what ``--gpus N`` does where torch sees no GPU."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time

import pytest
import torch

from ltx_mgpu.cli import checks
from ltx_mgpu.wire import rendezvous


def test_a_process_record_survives_a_step_of_the_wall_clock(monkeypatch):
    """Issue 29, finding 10: ``generate --gpus 2`` started its own pool beside a running detached
    one of the same GPU set. The only path from a live pool to a second start is its record
    turning "dead": psutil's ``create_time()`` adds the boot time that the kernel derives from the
    wall clock (re-read in whole seconds on every call), so a clock step moved it and the 0.05 s
    comparison failed. Records hold the start time since boot instead."""
    import psutil._pslinux as pslinux  # the wall clock as psutil reads it (Linux)

    me = os.getpid()
    recorded = rendezvous.process_start(me)
    booted = pslinux.boot_time()
    monkeypatch.setattr(pslinux, "boot_time", lambda: booted + 1.0)  # the clock was stepped by a second
    assert rendezvous.same_process(me, recorded)
    assert rendezvous.process_start(me) == recorded
    assert not rendezvous.same_process(me, recorded + 1.0)  # another start time is another process


def _forged(d, pid: int, dir: str | None = None) -> rendezvous.PoolInfo:
    """Write a ``pool.json`` into ``d`` naming ``pid`` (and recording ``dir``, default ``d``)."""
    info = rendezvous.PoolInfo(pid=pid, create_time=rendezvous.process_start(pid), gpus=[], nproc=2, device="cpu",
                               version="0", protocol=1, start_time=time.time(), lifetime="detached", owner_pid=None,
                               master_port=1, instance="forged", dir=dir or str(d))
    rendezvous.write_private(d / rendezvous.INFO_NAME, json.dumps(dataclasses.asdict(info)).encode())
    return info


def test_a_pool_json_naming_a_process_that_is_not_the_pools_describes_no_live_pool(tmp_path):
    """Issue 29, finding 13: a forged ``pool.json`` naming a live process of this user: the pool
    it describes is not alive (the process's command line does not name the runtime directory),
    so ``pool stop`` never says it stopped it and ``pool status`` does not wait to attach; a file
    copied from another directory is not read at all."""
    d = rendezvous.ensure_private_dir(tmp_path / "run" / "cpu-2")
    victim = os.getpid()  # a live process of this user that is no pool's
    info = _forged(d, victim)
    assert rendezvous.same_process(victim, info.create_time)  # the process itself runs
    assert rendezvous.PoolInfo.read(d) == info and not info.alive()
    _forged(d, victim, dir=str(tmp_path))  # recorded for another directory
    assert rendezvous.PoolInfo.read(d) is None


def test_nothing_is_made_inside_a_runtime_base_that_is_a_link(tmp_path):
    """Issue 29, finding 12: with the runtime base a symbolic link, the refusal came after
    ``cpu-2/`` was made inside the link's target."""
    target = tmp_path / "target"
    target.mkdir()
    base = tmp_path / "base"
    base.symlink_to(target)
    with pytest.raises(PermissionError, match="is a symbolic link"):
        rendezvous.ensure_private_dir(base / "cpu-2")
    assert list(target.iterdir()) == []


# --------------------------------------------------------------------------- --gpus N where torch sees no GPU


def test_gpus_on_a_machine_without_gpus_run_cpu_ranks_with_one_warning(monkeypatch):
    """Issue 31, item 6: decided to warn, not refuse, where the machine has no GPU at all: CPU
    ranks are then what the user can have (the README's main job runs that way)."""
    monkeypatch.setattr(checks, "nvidia_gpus_present", lambda: False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    text = checks.cpu_ranks_instead("--gpus 4", 4, "--cpu --gpus 4")
    assert text == ("warning: --gpus 4: torch sees no GPU here, so this runs 4 CPU ranks (gloo) on 2 CPU cores; ask "
                    "for CPU ranks with --cpu --gpus 4 to silence this")
    assert "\n" not in text


def test_gpus_torch_cannot_see_on_a_machine_that_has_them_are_refused(monkeypatch):
    """... and to refuse where the machine has NVIDIA GPUs that torch does not see (a CPU-only
    wheel): a CPU run of a real model would take hours before anyone noticed."""
    monkeypatch.setattr(checks, "nvidia_gpus_present", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match=re.escape(f"--gpus 2: this machine has NVIDIA GPUs but torch sees none (torch "
                                                   f"{torch.__version__} is a CPU-only build); install a CUDA build "
                                                   "of torch, or ask for CPU ranks with --cpu --gpus 2")):
        checks.cpu_ranks_instead("--gpus 2", 2, "--cpu --gpus 2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match=r"\(CUDA_VISIBLE_DEVICES hides them\)"):
        checks.cpu_ranks_instead("--gpus 2", 2, "--cpu --gpus 2")


def test_pool_start_and_encode_read_a_bare_gpus_count_with_the_same_decision(monkeypatch, capsys):
    from ltx_mgpu.cli.pool import cli_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(checks, "nvidia_gpus_present", lambda: False)
    assert cli_gpus("2", None, starting=True) == ("cpu", 2)
    assert "warning: --gpus 2: torch sees no GPU here" in capsys.readouterr().err
    assert cli_gpus("2", None) == ("cpu", 2)  # pool status / stop: finding a pool, nothing said
    assert cli_gpus(None, None, starting=True) == (None, None) and capsys.readouterr().err == ""
    monkeypatch.setattr(checks, "nvidia_gpus_present", lambda: True)
    with pytest.raises(ValueError, match="this machine has NVIDIA GPUs but torch sees none"):
        cli_gpus("2", None, starting=True)
    with pytest.raises(ValueError, match=r"the default \(every GPU\): this machine has NVIDIA GPUs"):
        cli_gpus(None, None, starting=True)
    assert cli_gpus("cpu", 2, starting=True) == ("cpu", 2)  # asked for explicitly: no word


def test_a_model_path_that_does_not_exist_is_named_by_its_flag(tmp_path):
    checks.check_paths_exist(gemma=str(tmp_path), projection=None)
    with pytest.raises(FileNotFoundError, match=f"--connectors {tmp_path / 'nope'}: no such file or directory"):
        checks.check_paths_exist(gemma=str(tmp_path), connectors=str(tmp_path / "nope"))
