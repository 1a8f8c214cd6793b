"""A container's manifest is checked at open: its model hash (an edit that changes the answer is caught) and its
shape (a malformed manifest is "corrupt: convert again", never a KeyError)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.errors import ModelFormatError
from engine.formats.container import MANIFEST, Container, model_hash
from engine.kv import KVCache
from engine.loader import load_model
from support.tiny_checkpoint import edit_manifest, tiny_container, write_tiny

CORRUPT = r"the container is corrupt: convert the model again with `colibri convert`"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    src = write_tiny(tmp_path_factory.mktemp("src") / "tiny")
    return tiny_container(src, tmp_path_factory.mktemp("out") / "q4")


@pytest.fixture
def container(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the converted container, to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "q4"))


def _set(path: tuple, value):
    def edit(m):
        node = m
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return m
    return edit


def _first_quant(m: dict) -> str:
    return next(n for n, e in sorted(m["tensors"].items()) if e["kind"] == "quant")


def test_the_pristine_container_opens_and_runs(container: Path) -> None:
    c = Container.open(container)
    assert c.manifest["version"] == 2 and c.model_hash == model_hash(c.manifest)
    model = load_model(container)
    logits = model.model.forward([1, 2, 3], KVCache(model.spec, 16))
    assert np.isfinite(logits).all()


@pytest.mark.parametrize(("key", "value"), [("num_experts_per_tok", 1), ("rope_theta", 1000900.0)])
def test_an_edited_config_value_is_caught_by_the_hash(container: Path, key: str, value) -> None:
    # the repro: top-k 8 -> 4 ran with logits off by 0.42, rope_theta +900 moved them by 0.047
    edit_manifest(container, _set(("config", key), value))
    with pytest.raises(ModelFormatError, match=r"manifest\.json: the manifest does not match its model hash.*" + CORRUPT):
        Container.open(container)
    with pytest.raises(ModelFormatError, match="does not match its model hash"):
        load_model(container)


@pytest.mark.parametrize("edit", ["plan", "offset", "extent", "buffer"])
def test_fields_outside_the_old_hash_are_covered(container: Path, edit: str) -> None:
    """Version 2 hashes the whole manifest: an edited plan, offset or extent is caught before any read."""
    def change(m):
        name = _first_quant(m)
        if edit == "plan":
            m["plan"]["bits_per_weight"] = 3.0
        elif edit == "offset":
            m["tensors"][name]["offset"] += 64
        elif edit == "extent":
            m["experts"][0]["crc32"] ^= 1
        else:   # the scales read from the codes' bytes: inside the span, so no CRC would notice
            assert m["tensors"][name]["buffers"]["scales"][0] > 0
            m["tensors"][name]["buffers"]["scales"][0] = 0
        return m
    edit_manifest(container, change)
    with pytest.raises(ModelFormatError, match="does not match its model hash.*" + CORRUPT):
        Container.open(container, verify=False)


def test_the_source_path_is_not_part_of_the_identity(container: Path) -> None:
    """The same model converted from a copy elsewhere is the same model: sidecars stay bound to it."""
    before = Container.open(container).model_hash
    edit_manifest(container, _set(("source", "path"), "/elsewhere/tiny"))
    assert Container.open(container).model_hash == before


def _rehash(m: dict) -> dict:
    m["model_hash"] = model_hash(m)
    return m


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: [m], "the manifest is a JSON list, expected an object"),
    (lambda m: {**m, "tensors": [1, 2]}, "'tensors' is .*expected a JSON object"),
    (lambda m: {**m, "model_hash": None}, "'model_hash' is None"),
    (lambda m: {**m, "version": "2"}, "format version '2' is not a version number"),
])
def test_a_manifest_of_the_wrong_shape_is_corrupt(container: Path, edit, message: str) -> None:
    path = container / MANIFEST
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))
    with pytest.raises(ModelFormatError, match=message + ".*" + CORRUPT):
        Container.open(container)


def _quant_edit(what: str):
    def edit(m):
        name = _first_quant(m)
        q = m["tensors"][name]["quant"]
        if what == "renamed":
            q["grou%"] = q.pop("group")            # the repro: KeyError before
        elif what == "bits":
            q["bits"] = 8 if q["bits"] != 8 else 4  # ValueError from the buffers' sizes before
        elif what == "kind":
            m["tensors"][name]["kind"] = "f64"
        elif what == "file":
            m["tensors"][name]["file"] = "../../etc/passwd"
        elif what == "shape":
            m["tensors"][name]["shape"] = ["8", 64]
        return m
    return edit


@pytest.mark.parametrize(("what", "message"), [
    ("renamed", r"quant has unknown key\(s\) 'grou%'|quant lacks group"),
    ("bits", None),                      # with the hash recomputed: the buffers cannot hold the other width
    ("kind", "has kind 'f64'"),
    ("file", "names file '../../etc/passwd'"),
    ("shape", "shape is '8'"),
])
@pytest.mark.parametrize("rehash", [False, True])
def test_damaged_tensor_entries_are_corrupt(container: Path, what: str, message: str | None, rehash: bool) -> None:
    """Without the hash recomputed the hash catches it; with it recomputed (a tool that rewrote the manifest) the
    schema does: either way a ModelFormatError, never a KeyError or ValueError."""
    edit = _quant_edit(what)
    edit_manifest(container, (lambda m: _rehash(edit(m))) if rehash else edit)
    with pytest.raises(ModelFormatError, match=CORRUPT) as info:
        Container.open(container, verify=False).load(_first_quant(json.loads((container / MANIFEST).read_text())))
    if rehash and message is not None:
        assert info.match(message)


def test_bits_changed_and_rehashed_fails_at_load_with_the_tensor_named(container: Path) -> None:
    edit_manifest(container, lambda m: _rehash(_quant_edit("bits")(m)))
    name = _first_quant(json.loads((container / MANIFEST).read_text()))
    c = Container.open(container, verify=False)      # the schema holds: 8 is a width Colibri has
    with pytest.raises(ModelFormatError, match=rf"tensor {name}: .*" + CORRUPT):
        c.load(name)


def test_a_version_1_container_stays_readable_and_checked(container: Path) -> None:
    """Containers written before the whole-manifest hash open with the old hash, which covers the config."""
    def as_v1(m):
        m["version"] = 1
        digest = hashlib.sha256(json.dumps(m["config"], sort_keys=True).encode())
        for name, e in sorted(m["tensors"].items()):
            digest.update(json.dumps([name, e["kind"], e["shape"], e.get("quant"), e["crc32"]], sort_keys=True).encode())
        m["model_hash"] = digest.hexdigest()
        return m
    edit_manifest(container, as_v1)
    c = Container.open(container)
    assert c.model_hash == model_hash(c.manifest)
    edit_manifest(container, _set(("config", "num_experts_per_tok"), 1))
    with pytest.raises(ModelFormatError, match="does not match its model hash"):
        Container.open(container)


def test_a_deeply_nested_manifest_is_corrupt(container: Path) -> None:
    (container / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelFormatError, match=CORRUPT):
        Container.open(container)
