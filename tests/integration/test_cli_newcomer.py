"""What a newcomer running the README meets first: a fast ``--help``, honest progress on stderr
(the Gemma 3 270M conversion, ``encode``), a ``bench`` summary that reads right, error messages
that name the fix, counts in the right number, and docs that say where things are."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from ltx_mgpu.cli.main import main

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- --help imports no torch


def _imported(args: list[str]) -> tuple[int, set[str]]:
    """Run ``python -X importtime <args>`` from the repository root: (exit status, modules imported)."""
    out = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    names = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    return out.returncode, names


@pytest.mark.parametrize("argv, status", [
    (["--help"], 0),
    (["encode", "--help"], 0),
    (["generate", "--help"], 0),
    (["pool", "status", "--help"], 0),
    (["bench", "--help"], 0),
    (["generate", "--prompt", "x", "--frames", "many"], 2),  # an argument error
    (["encode"], 2),  # a missing required argument
])
def test_help_and_argument_errors_import_no_torch(argv, status):
    rc, modules = _imported(["-m", "ltx_mgpu", *argv])
    assert rc == status
    assert "ltx_mgpu.cli.main" in modules  # the measurement saw the CLI
    heavy = {m for m in modules if m.split(".")[0] in ("torch", "transformers", "safetensors", "numpy", "ltx_core")}
    assert not heavy, sorted(heavy)[:10]


def test_building_the_parser_imports_no_torch():
    code = ("import sys; from ltx_mgpu.cli.main import build_parser; p = build_parser(); "
            "names = {a.dest for a in p._subparsers._group_actions[0].choices['encode']._actions}; "
            "assert 'progress' in names, names; "
            "assert 'torch' not in sys.modules, 'torch was imported'; print(sorted(p._subparsers._group_actions[0]"
            ".choices))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert all(c in out.stdout for c in ("encode", "generate", "pool", "bench", "make-assets", "quantize-nf4"))


def test_the_light_packages_default_seed_is_the_stores():
    import ltx_mgpu.assets as assets
    from ltx_mgpu.assets import store

    assert assets.DEFAULT_SEED == store.DEFAULT_SEED


# --------------------------------------------------------------------------- the Gemma 3 270M conversion


def test_the_270m_conversion_reports_each_stage_at_info(monkeypatch, tmp_path, caplog):
    """Every stage is reported as it starts and the closing line gives each stage's seconds;
    nothing is logged above INFO (the conversion is expected, not a warning). The GGUF and
    transformers are stubbed: the stages, not the weights, are under test."""
    import transformers

    from ltx_mgpu.assets import gemma270m

    calls = []

    class Saved:
        def __init__(self, what):
            self.what, self.config, self.hf_quantizer, self.padding_side = what, types.SimpleNamespace(), object(), None

        def save_pretrained(self, out):
            calls.append(self.what)
            (Path(out) / f"{self.what}.json").write_text("{}")

    def assemble(output_path):
        Path(output_path).write_bytes(b"GGUF")
        return Path(output_path)

    monkeypatch.setitem(sys.modules, gemma270m.PACKAGE, types.SimpleNamespace(assemble=assemble))
    monkeypatch.setattr(gemma270m, "gemma_270m_available", lambda: True)
    monkeypatch.setattr(transformers.Gemma3ForCausalLM, "from_pretrained", classmethod(lambda cls, *a, **k:
                                                                                          Saved("model")))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(lambda cls, *a, **k:
                                                                                      Saved("tokenizer")))
    lines: list[str] = []
    with caplog.at_level(logging.DEBUG, logger=gemma270m.__name__):
        path = gemma270m.gemma_270m_dir(tmp_path, report=lines.append)
    assert path == tmp_path / gemma270m.SNAPSHOT_NAME and calls == ["model", "tokenizer"]
    assert (path / "model.json").is_file()
    assert lines[0].startswith("converting the real Gemma 3 270M") and str(path) in lines[0]
    assert lines[1:5] == [f"[{k}/4] {stage}" for k, stage in enumerate(gemma270m.STAGES, 1)]
    assert re.fullmatch(r"converted the Gemma 3 270M in \d+ s \(assemble [\d.]+ s, weights [\d.]+ s, "
                        r"tokenizer [\d.]+ s, save [\d.]+ s\); later runs load the snapshot", lines[5]), lines[5]
    assert [r.levelno for r in caplog.records if r.name == gemma270m.__name__] == [logging.INFO] * 6
    lines.clear()
    assert gemma270m.gemma_270m_dir(tmp_path, report=lines.append) == path and not lines  # built: silent


def test_the_270m_conversion_goes_to_stderr_by_default(monkeypatch, tmp_path, capsys):
    from ltx_mgpu.assets import gemma270m

    monkeypatch.setattr(gemma270m, "gemma_270m_available", lambda: True)
    monkeypatch.setattr(gemma270m, "build_gemma_270m_snapshot", lambda out, report: (out.mkdir(), report("[1/4] x")))
    gemma270m.gemma_270m_dir(tmp_path)
    captured = capsys.readouterr()
    assert "converting the real Gemma 3 270M" in captured.err and "[1/4] x" in captured.err and not captured.out


# --------------------------------------------------------------------------- bench's summary

#: ``python benchmarks/bench_socket.py``'s output, as captured (trimmed), with one goal missed.
SOCKET_SAMPLE = """\
pool: 2 rank(s) on cpu, ltx_mgpu 0.1.0, torch 2.13.0+cpu, shm arena on
measure                                                        value  rate / goal
pool start (torchrun + ranks + hello)                         1.57 s
round trip: status (median)                                  0.44 ms  <= 5 ms
round trip: selftest, 0 steps (median)                       6.51 ms  <= 5 ms
12.5 MB result, pool -> client, socket                       4.12 ms    3.04 GB/s
  as bf16 -> float32 in hand, socket                         5.67 ms    2.20 GB/s
12.5 MB memcpy into a fresh buffer                           0.34 ms   36.52 GB/s
100 MB result, pool -> client, socket                       60.51 ms    1.65 GB/s
  as bf16 -> float32 in hand, socket                       143.43 ms    0.70 GB/s
100 MB memcpy into a fresh buffer                            4.77 ms   20.98 GB/s
"""


def test_bench_socket_rows_keep_each_sizes_times_indentation_and_goals():
    from ltx_mgpu.cli.bench import format_table, socket_rows

    rows = socket_rows(SOCKET_SAMPLE)
    assert [r[1] for r in rows] == [
        "pool start (torchrun + ranks + hello)", "round trip: status (median)",
        "round trip: selftest, 0 steps (median)", "12.5 MB result, pool -> client, socket",
        "  as bf16 -> float32 in hand, socket", "12.5 MB memcpy into a fresh buffer",
        "100 MB result, pool -> client, socket", "  as bf16 -> float32 in hand, socket",
        "100 MB memcpy into a fresh buffer"]
    by_row = {(i, r[1]): r for i, r in enumerate(rows)}
    assert by_row[(4, "  as bf16 -> float32 in hand, socket")][2] == "5.67 ms"  # 12.5 MB's, not 100 MB's
    assert by_row[(7, "  as bf16 -> float32 in hand, socket")][2] == "143.43 ms"
    assert rows[1][3] == "goal <= 5 ms: met" and rows[2][3] == "MISSED goal <= 5 ms"
    assert rows[3][3] == f"3.04 GB/s, {4.12 / 0.34:.1f}x the fresh memcpy"
    assert rows[7][3] == f"0.70 GB/s, {143.43 / 4.77:.1f}x the fresh memcpy"  # against its own size's memcpy
    assert rows[5][3] == "36.52 GB/s, the reference"
    assert all(r[0] == "socket" and r[3] for r in rows)  # no empty ratio cell
    table = format_table(rows).splitlines()
    assert len(table) == len(rows) + 2
    assert any(re.match(r"^socket\s{2,}  as bf16 -> float32 in hand, socket\s+143\.43 ms  0\.70 GB/s", line)
               for line in table), table  # the indentation survives


def test_bench_reads_the_committed_socket_log():
    from ltx_mgpu.cli.bench import socket_rows

    log = (REPO / "benchmarks" / "results" / "socket_cpu.log").read_text()
    rows = socket_rows(log)
    timed = [line for line in log.splitlines() if re.search(r"\d (ms|s)\s", line + " ") and "value" not in line]
    assert len(rows) == len(timed) and all(r[3] for r in rows)
    assert ("socket", "100 MB result, pool -> client, socket", "60.51 ms",
            f"1.65 GB/s, {60.51 / 4.77:.1f}x the fresh memcpy") in rows


def test_bench_finds_the_checkouts_benchmark_scripts():
    from ltx_mgpu.cli.bench import BENCHMARKS, benchmarks_dir

    assert benchmarks_dir() == REPO / "benchmarks"  # it looked in ltx_mgpu/benchmarks and refused to run
    assert all((benchmarks_dir() / f"bench_{n}.py").is_file() for n in BENCHMARKS if n != "cache")


def test_bench_says_which_goals_were_missed_and_where_the_raw_results_are(tmp_path):
    from ltx_mgpu.cli.bench import closing_lines, socket_rows

    rows = socket_rows(SOCKET_SAMPLE)
    (tmp_path / "socket.txt").write_text(SOCKET_SAMPLE)
    (tmp_path / "text.json").write_text("{}")
    lines = closing_lines(rows, tmp_path)
    assert lines == ["1 goal missed: round trip: selftest, 0 steps (median) took 6.51 ms (goal <= 5 ms)",
                     f"raw results in {tmp_path}: socket.txt, text.json"]
    assert closing_lines(rows[:2], tmp_path / "none") == [
        "no raw results were written: the numbers are in the output above"]


# --------------------------------------------------------------------------- Gemma / projection mismatch


def test_a_projection_for_another_gemma_says_which_gemma_it_was_made_for(tmp_path, capsys, tiny_gemma_dir,
                                                                         assets_root):
    from ltx_mgpu.assets import tiny_ltx_checkpoint_gemma270m

    ckpt = tiny_ltx_checkpoint_gemma270m("2.3", assets_root)  # sized for the 270M: 19 x 640
    rc = main(["encode", "--gemma", str(tiny_gemma_dir), "--projection", str(ckpt), "--prompt", "x", "--no-cache",
               "--out", str(tmp_path / "e.safetensors"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "belongs to the Gemma 3 270M (the embedded default) (19 hidden states of width 640)" in err
    assert "not to this Gemma with 7 hidden states" in err and "Pass the checkpoint (or projection file) made" in err
    assert "not divisible" not in err


def test_load_projection_and_check_pairing_name_the_projections_gemma(tiny_ltx_23):
    from ltx_mgpu.text.encoder.placement import GemmaShape, ProjectionShape, check_pairing
    from ltx_mgpu.text.features import ProjectionFormatError, load_projection, projection_gemma

    with pytest.raises(ProjectionFormatError, match=r"belongs to the embedded tiny Gemma 3 \(7 hidden states of "
                                                    r"width 64\), not to this Gemma with 19 hidden states"):
        load_projection(tiny_ltx_23, num_layers=19)
    with pytest.raises(ValueError, match=r"belongs to the embedded tiny Gemma 3 .* gives 19 hidden states of width "
                                         r"640 .*Pair the checkpoint with its Gemma: pass the checkpoint"):
        check_pairing(GemmaShape("snapshot", 18, 640), ProjectionShape("2.3", 448, 6144), "/g", "/p")
    assert projection_gemma(49 * 3840) == "Gemma 3 12B (49 hidden states of width 3840)"
    assert "make 1000 (Gemma 3 12B" in projection_gemma(1000)


# --------------------------------------------------------------------------- encode's progress


def _encode(tmp_path, gemma, projection, *extra):
    return main(["encode", "--gemma", str(gemma), "--projection", str(projection), "--dtype", "float32",
                 "--out", str(tmp_path / "e.safetensors"), "--cache", str(tmp_path / "cache"), *extra])


def test_encode_draws_progress_bars_on_stderr(tmp_path, capsys, tiny_gemma_dir, tiny_ltx_23):
    rc = _encode(tmp_path, tiny_gemma_dir, tiny_ltx_23, "--prompt", "a fox", "--prompt", "a cat",
                 "--batch-size", "1")
    out, err = capsys.readouterr()
    assert rc == 0
    # tqdm redraws at most every 0.1 s, so a fast middle tick may not be drawn; the ends always are
    assert re.search(r"load Gemma\s*: 0/1", err) and re.search(r"load Gemma\s*: 1/1", err), err
    assert re.search(r"encode\s*: 0/2", err) and re.search(r"encode\s*: 2/2", err), err
    assert "load Gemma" not in out and "wrote 2 embeddings to" in out
    # all cached now: no Gemma load, no bar
    rc = _encode(tmp_path, tiny_gemma_dir, tiny_ltx_23, "--prompt", "a fox")
    out, err = capsys.readouterr()
    assert rc == 0 and "load Gemma" not in err and "encode" not in err and "wrote 1 embedding to" in out


def test_encode_no_progress_draws_nothing(tmp_path, capsys, tiny_gemma_dir, tiny_ltx_23):
    rc = _encode(tmp_path, tiny_gemma_dir, tiny_ltx_23, "--prompt", "a dog", "--no-progress")
    err = capsys.readouterr().err
    assert rc == 0 and "load Gemma" not in err and "encode" not in err


def test_encode_refuses_a_batch_size_below_one(tmp_path, capsys, tiny_gemma_dir, tiny_ltx_23):
    rc = _encode(tmp_path, tiny_gemma_dir, tiny_ltx_23, "--prompt", "a dog", "--batch-size", "0")
    assert rc == 2 and "--batch-size 0: give at least 1" in capsys.readouterr().err


# --------------------------------------------------------------------------- counts and skip reasons


def test_counts_take_the_singular_for_one():
    from ltx_mgpu.cli.pipeline import GenerateReport
    from ltx_mgpu.cli.wording import plural

    assert (plural(1, "frame"), plural(0, "frame"), plural(25, "frame")) == ("1 frame", "0 frames", "25 frames")
    fields = {f.name for f in dataclasses.fields(GenerateReport)}
    report = GenerateReport(**{
        **dict.fromkeys(fields, 0), "video_path": Path("x.mp4"), "latents_path": Path("x.latents.safetensors"),
        "frames": 1, "steps": 1, "world_size": 1, "device": "cpu", "fps": 25.0, "cfg": 1.0, "codec": "mpeg4",
        "pool_models": [], "seconds": {}, "audio_note": None, "pool_pid": 1, "audio": False, "embedded": False,
        "text_encoder_loaded": True, "pool_started": True, "seconds_per_step": 0.5})
    text = report.summary()
    assert "(1 frame," in text and "denoise: 1 step," in text and "(cpu rank)" in text
    assert not re.search(r"\b1 (frames|steps|ranks|prompts|embeddings)\b", text)


def test_skip_reasons_name_what_is_needed_not_a_machine_kind():
    reasons = []
    for path in sorted((REPO / "tests").glob("**/test_*.py")):
        reasons += re.findall(r"reason=f?\"([^\"]*)\"", path.read_text())
    assert reasons and not [r for r in reasons if re.search(r"machine|nvidia-|h200", r, re.IGNORECASE)], reasons


# --------------------------------------------------------------------------- docs


def test_testing_doc_names_the_embedded_models_place_as_the_store_builds_it(monkeypatch, tmp_path):
    from ltx_mgpu.assets.store import ASSETS_VERSION, assets_dir

    monkeypatch.setenv("LTX_MGPU_HOME", str(tmp_path))
    assert assets_dir() == tmp_path / "assets" / f"v{ASSETS_VERSION}"
    doc = (REPO / "docs" / "testing.md").read_text()
    assert "$LTX_MGPU_HOME/assets/v<N>/" in doc and "~/.cache/ltx_mgpu/assets/v<N>/" in doc
    assert "ASSETS_VERSION" in doc
    readme = (REPO / "README.md").read_text()
    assert "about 45 s" not in readme and "docs/testing.md" in readme


# --------------------------------------------------------------------------- bad arguments answer at once


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--frames", "24"], "--frames 24: LTX-2 takes 8k+1 frames"),
    (["generate", "--prompt", "x", "--height", "250"], "--height 250: LTX-2 takes multiples of 32 pixels"),
    (["generate", "--prompt", "x", "--checkpoint", "{tmp}/nope.safetensors", "--gemma", "{tmp}"],
     "--checkpoint {tmp}/nope.safetensors: no such file or directory"),
    (["generate", "--prompt", "x", "--checkpoint", "{tmp}", "--gemma", "{tmp}/gemma-3-12b"],
     "--gemma {tmp}/gemma-3-12b: no such file or directory"),
    (["encode", "--prompt", "x", "--out", "{tmp}/e.safetensors", "--gemma", "{tmp}/gemma-3-12b", "--projection",
      "{tmp}"], "--gemma {tmp}/gemma-3-12b: no such file or directory"),
    (["encode", "--prompt", "x", "--out", "{tmp}/e.npy"], "give a name ending in .safetensors"),
    (["encode", "--prompt", "x", "--out", "{tmp}/e.safetensors", "--gpus", "2"], "add --pool"),
], ids=["frames", "height", "checkpoint-missing", "gemma-missing", "encode-gemma-missing", "encode-out",
        "encode-gpus-without-pool"])
def test_a_bad_argument_is_answered_before_torch_is_imported(argv, message, tmp_path):
    """Issue 31, item 5: ``--frames 24`` or ``--height 250`` took 5 s (20-28 s under load) because
    the checks ran after the heavy imports, and a wrong ``--gemma`` path was reported only after a
    pool had started. Every check that needs no file's contents now runs first: the error comes
    with torch never imported (no timing asserted: which modules were loaded is the measure)."""
    argv = [a.format(tmp=tmp_path) for a in argv]
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "ltx_mgpu", *argv], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    errors = [line for line in out.stderr.splitlines() if not line.startswith("import time:")]
    modules = {line.rsplit("|", 1)[1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert out.returncode == 2 and errors == [f"error: {message.format(tmp=tmp_path)}"] or (
        out.returncode == 2 and len(errors) == 1 and message.format(tmp=tmp_path) in errors[0]), out.stderr[-2000:]
    assert "ltx_mgpu.cli.main" in modules
    assert not {m for m in modules if m.split(".")[0] in ("torch", "transformers", "ltx_core")}


def test_a_gemma_that_is_not_one_is_named_before_any_pool_starts(tmp_path, capsys, tiny_ltx_23):
    """The Gemma source's format (file names and headers) is checked with the checkpoint's, before
    a pool starts (it was found only when the prompts were encoded, in the pool)."""
    runtime = tmp_path / "run"
    rc = main(["generate", "--prompt", "x", "--out", str(tmp_path / "x.mp4"), "--runtime-dir", str(runtime),
               "--checkpoint", str(tiny_ltx_23), "--gemma", str(tiny_ltx_23)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: {tiny_ltx_23}") and "Traceback" not in err
    assert not runtime.exists()  # no pool was started (nor its directory made)
