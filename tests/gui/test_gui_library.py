"""The model library (pytest-qt, offscreen): the models folder as a table read from each model's own files, with
Open, Convert, Reveal and Delete; the model loaded now cannot be deleted."""

from __future__ import annotations

import shutil

import pytest

from support.qt import *  # noqa: F403 - the GUI fixtures (no_leftovers is autouse)
from support.qt import LOAD_TIMEOUT_MS


@pytest.fixture
def library_folder(tmp_path, models):
    """A models folder holding the tiny model as a Hugging Face folder and a container, a GGUF file left by
    `colibri pull` in a subfolder, a damaged folder and an unfinished pull."""
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copytree(models[0], folder / "tiny-chat-moe")
    shutil.copytree(models[1], folder / "tiny-chat-moe-q4")
    (folder / "tiny-chat-moe-q4" / "atlas.json").write_text("{}")
    (folder / "pulled").mkdir()
    _q8_gguf(folder / "pulled" / "tiny.Q8_0.gguf")
    (folder / "broken").mkdir()
    (folder / "broken" / "config.json").write_text("{not json")
    (folder / ".half-done.partial").mkdir()
    return folder


def test_the_library_lists_each_model_from_its_files(qtbot, make_window, library_folder, models):
    from app.library import scan

    entries = {e.name: e for e in scan(library_folder)}
    assert sorted(entries) == ["broken", "pulled/tiny.Q8_0.gguf", "tiny-chat-moe", "tiny-chat-moe-q4"]
    hf, q4, gguf = entries["tiny-chat-moe"], entries["tiny-chat-moe-q4"], entries["pulled/tiny.Q8_0.gguf"]
    assert (hf.kind, hf.family, hf.bits, hf.atlas) == ("Hugging Face", "mixtral", 32.0, False)
    assert (q4.kind, q4.family, q4.params, q4.atlas) == ("container", "mixtral", hf.params, True)
    assert 4.0 < q4.bits < 5.0 and q4.size < hf.size / 4        # 4-bit values and their scales
    assert gguf.kind == "GGUF" and gguf.family == "llama" and gguf.params > 0 and 8.0 <= gguf.bits < 9.0
    assert entries["broken"].problem and "JSONDecodeError" in entries["broken"].problem

    window = make_window()
    window.settings.setValue("paths/models", str(library_folder))
    dlg = window.show_library()
    rows = [[dlg.table.item(i, j).text() for j in range(dlg.table.columnCount())] for i in range(dlg.table.rowCount())]
    assert [r[0] for r in rows] == sorted(entries) and str(library_folder) in dlg.heading.text()
    q4_row = rows[[r[0] for r in rows].index("tiny-chat-moe-q4")]
    assert q4_row[1] == "mixtral" and q4_row[2] == "502 K" and q4_row[5] == "container" and q4_row[6] == "yes"
    dlg.select("tiny-chat-moe-q4")
    assert not dlg.convert_button.isEnabled() and "quantized already" in dlg.convert_button.toolTip()
    dlg.select("broken")
    assert not dlg.open_button.isEnabled() and dlg.delete_button.isEnabled()
    # Convert proposes the selected source; Open loads it and closes the library
    dlg.select("tiny-chat-moe")
    dlg.convert_button.click()
    convert = window.models.convert_dialog
    assert convert.source.text() == str(library_folder / "tiny-chat-moe") and convert.output.text().endswith("-q4")
    convert.reject()
    dlg.select("tiny-chat-moe-q4")
    with qtbot.waitSignal(window.bridge.modelLoaded, timeout=LOAD_TIMEOUT_MS):
        dlg.open_button.click()
    assert window.library is None and window.info.path == library_folder / "tiny-chat-moe-q4"


def test_delete_asks_first_and_refuses_the_model_loaded_now(qtbot, make_window, library_folder, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    import ui.library

    window = make_window(library_folder / "tiny-chat-moe-q4")
    window.settings.setValue("paths/models", str(library_folder))
    dlg = window.show_library()
    dlg.select("tiny-chat-moe-q4")
    assert dlg.ask_delete() is None and "loaded now" in dlg.status.text()
    assert (library_folder / "tiny-chat-moe-q4").is_dir()
    revealed = []
    monkeypatch.setattr(ui.library, "reveal", lambda path: revealed.append(path) or True)
    dlg.select("pulled/tiny.Q8_0.gguf")
    dlg.reveal_button.click()
    assert revealed == [library_folder / "pulled" / "tiny.Q8_0.gguf"]
    box = dlg.ask_delete()                                  # Cancel keeps it
    box.button(QMessageBox.StandardButton.Cancel).click()
    assert (library_folder / "pulled" / "tiny.Q8_0.gguf").is_file()
    dlg.select("tiny-chat-moe")
    box = dlg.ask_delete()
    assert "cannot be undone" in box.text()
    box.button(QMessageBox.StandardButton.Yes).click()
    assert not (library_folder / "tiny-chat-moe").exists() and "Deleted tiny-chat-moe" in dlg.status.text()
    assert "tiny-chat-moe" not in [e.name for e in dlg.entries] and dlg.table.rowCount() == 3
    dlg.close()


def test_delete_refuses_a_path_outside_the_models_folder(tmp_path):
    from app.library import ModelEntry, delete_model
    from engine.errors import ColibriError

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    with pytest.raises(ColibriError, match="not inside the models folder"):
        delete_model(ModelEntry(outside, "elsewhere", "Hugging Face"), tmp_path / "models")
    assert outside.is_dir()



def _q8_gguf(path) -> None:
    """A GGUF file of one Q8_0 matrix, as llama.cpp's tools write them."""
    import gguf
    import numpy as np

    q8 = gguf.GGMLQuantizationType.Q8_0
    data = gguf.quants.quantize(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32), q8)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.attn_q.weight", data, raw_shape=data.shape, raw_dtype=q8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
