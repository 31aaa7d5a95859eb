"""``make-assets --comfyui`` without ComfyUI: a wrong folder refused at once naming what was looked
for, and the tiny workflow copies are the shipped ones with only their model pickers changed (the
real-ComfyUI run of every copy is ``tests/comfyui/test_comfyui_try_it.py``)."""

from __future__ import annotations

import json

import pytest

from ltx_mgpu.assets import comfyui_root
from ltx_mgpu.assets.comfyui import MODEL_INPUTS, shipped_workflows, tiny_api_workflow, tiny_ui_workflow
from ltx_mgpu.cli.main import main

PICKS = {"checkpoint": "ltx-mgpu-test_tiny-ltx-2.3_for-tiny-gemma-3.safetensors",
         "gemma": "ltx-mgpu-test_tiny-gemma-3_for-tiny-ltx-2.3/",
         "projection": "checkpoints/ltx-mgpu-test_tiny-ltx-2.3_for-tiny-gemma-3.safetensors"}


def test_a_folder_that_is_not_comfyui_is_refused_naming_what_was_looked_for(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"not a ComfyUI folder \(no main.py or models/ in "):
        comfyui_root(tmp_path / "nowhere")
    assert main(["make-assets", "--comfyui", str(tmp_path / "nowhere")]) == 2
    assert "give the folder that holds ComfyUI's main.py" in capsys.readouterr().err
    (tmp_path / "ComfyUI" / "models").mkdir(parents=True)
    assert comfyui_root(tmp_path / "ComfyUI") == (tmp_path / "ComfyUI").resolve()


@pytest.mark.parametrize("path", shipped_workflows(), ids=lambda p: p.stem)
def test_the_tiny_copies_change_only_the_model_pickers(path):
    shipped = json.loads(path.read_text())
    copy = tiny_ui_workflow(shipped, PICKS)
    assert json.loads(path.read_text()) == shipped  # the shipped dict is left as it was
    changed = 0
    for before, after in zip(shipped["nodes"], copy["nodes"]):
        slots = {index: role for index, role in (MODEL_INPUTS.get(before["type"]) or {}).values()}
        for i, (old, new) in enumerate(zip(before.get("widgets_values") or [], after.get("widgets_values") or [])):
            if i in slots:
                assert new == PICKS[slots[i]] and old != new
                changed += 1
            else:
                assert new == old, (before["type"], i)
        assert "models" not in after["properties"]  # the files are local: no downloads offered
        assert {k: v for k, v in before["properties"].items() if k != "models"} == after["properties"]
    assert changed >= 2
    api = json.loads((path.parent / "api" / f"{path.stem}.api.json").read_text())
    tiny = tiny_api_workflow(api, PICKS)
    for node_id, node in api.items():
        for name, value in node["inputs"].items():
            role = (MODEL_INPUTS.get(node["class_type"]) or {}).get(name)
            assert tiny[node_id]["inputs"][name] == (PICKS[role[1]] if role else value)
