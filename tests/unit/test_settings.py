"""The environment settings (``ltx_mgpu.settings``): declared once, read one way, listed once in
``docs/operations.md``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ltx_mgpu import settings

REPO = Path(__file__).resolve().parents[2]
SOURCES = [p for p in [*REPO.glob("ltx_mgpu/**/*.py"), *REPO.glob("nodes/*.py")] if p.name != "settings.py"]


def test_the_docs_list_every_setting_as_it_is_declared():
    table = (REPO / "docs" / "operations.md").read_text().split("## Environment settings", 1)[1]
    rows = [line for line in table.splitlines() if line.startswith("| `LTX_MGPU_")]
    assert rows == [s.doc_row() for s in settings.SETTINGS.values()]


def test_no_module_reads_an_ltx_mgpu_variable_by_hand():
    """Every LTX_MGPU_* variable is read through its Setting (``os.environ.get("LTX_MGPU_...")``
    elsewhere would be a second, unchecked parse)."""
    raw = re.compile(r"""(environ(\.get)?|getenv)\s*[\[(]\s*["']LTX_MGPU_""")
    bad = [f"{p.relative_to(REPO)}:{n}" for p in SOURCES for n, line in enumerate(p.read_text().splitlines(), 1)
           if raw.search(line)]
    assert not bad, bad
    named = {m for p in SOURCES for m in re.findall(r"LTX_MGPU_[A-Z_]+[A-Z]", p.read_text())}
    assert named <= set(settings.SETTINGS), sorted(named - set(settings.SETTINGS))


@pytest.mark.parametrize("setting, raw, value", [
    (settings.SHM, "0", False), (settings.SHM, " Off ", False), (settings.SHM, "yes", True),
    (settings.SHM_MIN_BYTES, "4096", 4096), (settings.TICK_SECONDS, "0.5", 0.5),
    (settings.MASTER_PORT, "29501", 29501), (settings.PROFILE_JOBS, " 3 ", 3), (settings.CUDA_ALLOC_CONF, "x", "x"),
])
def test_a_setting_reads_its_value(setting, raw, value):
    assert setting.get({setting.name: raw}) == value
    assert setting.get({}) == setting.default == setting.get({setting.name: "  "})  # unset or empty: the default


@pytest.mark.parametrize("setting, raw, what", [
    (settings.SHM, "maybe", "one of 1, on, true, yes, 0, off, false, no"),
    (settings.SHM_MIN_BYTES, "-1", "a whole number of bytes"),
    (settings.SHM_MIN_BYTES, "1e6", "a whole number of bytes"),
    (settings.TICK_SECONDS, "0", "a positive number of seconds"),
    (settings.TICK_SECONDS, "inf", "a positive number of seconds"),
    (settings.MASTER_PORT, "70000", "a TCP port, 1..65535"),
])
def test_a_value_it_cannot_read_is_an_error_naming_the_variable(setting, raw, what):
    with pytest.raises(ValueError, match=re.escape(f"${setting.name}={raw!r}: give {what}")):
        setting.get({setting.name: raw})


def test_a_directory_setting_must_not_name_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    assert settings.HOME.get({"LTX_MGPU_HOME": str(tmp_path / "d")}) == tmp_path / "d"
    with pytest.raises(ValueError, match=r"\$LTX_MGPU_HOME .*is a file, not a directory"):
        settings.HOME.get({"LTX_MGPU_HOME": str(tmp_path / "f" / "under")})
