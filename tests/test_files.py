"""online_opd/files.py: sha256, atomic writes of files and folders, and what a failure leaves behind."""

from __future__ import annotations

import json
import os

import pytest

from online_opd import files
from online_opd.files import (
    atomic_folder,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    is_temp_name,
    sha256_file,
    write_temp_bytes,
)


def test_sha256_file_matches_known_digests(tmp_path, monkeypatch):
    abc = tmp_path / "abc"
    abc.write_bytes(b"abc")  # FIPS 180-2 test vector
    assert sha256_file(abc) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert sha256_file(empty) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    monkeypatch.setattr(files, "_CHUNK_BYTES", 2)  # "abc" in two chunks hashes the same
    assert sha256_file(abc) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_atomic_writes_replace_content_and_leave_no_temp(tmp_path):
    path = tmp_path / "CURRENT"
    atomic_write_bytes(path, b"old")
    atomic_write_text(path, "né\n")
    assert path.read_bytes() == b"n\xc3\xa9\n"
    atomic_write_json(path, {"b": 1, "a": [2]}, sort_keys=True)
    assert path.read_text() == '{\n  "a": [\n    2\n  ],\n  "b": 1\n}\n'
    assert sorted(os.listdir(tmp_path)) == ["CURRENT"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path):
    path = tmp_path / "status.json"
    atomic_write_json(path, {"status": "candidate"})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"status": object()})  # not JSON: fails before any byte is written
    with pytest.raises(TypeError):
        atomic_write_bytes(path, "not bytes")  # fails inside the write, after the temp file exists
    assert json.loads(path.read_text()) == {"status": "candidate"}
    assert sorted(os.listdir(tmp_path)) == ["status.json"]


def test_atomic_write_file_streams_into_place_and_a_failed_writer_keeps_the_old_file(tmp_path):
    path = tmp_path / "f.bin"
    files.atomic_write_file(path, lambda tmp: tmp.write_bytes(b"one"))
    assert path.read_bytes() == b"one"

    def fails(tmp):
        tmp.write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_write_file(path, fails)
    assert path.read_bytes() == b"one" and [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_temp_names_are_hidden_tmp_siblings(tmp_path):
    tmp = write_temp_bytes(tmp_path / "seg", b"data")
    assert tmp.parent == tmp_path and is_temp_name(tmp.name) and tmp.name.startswith(".seg.")
    assert tmp.read_bytes() == b"data"
    assert not is_temp_name("seg-0001.parquet") and not is_temp_name(".lock")


def test_atomic_folder_publishes_whole_and_replaces_an_old_copy(tmp_path):
    target = tmp_path / "models" / "drafter"
    with atomic_folder(target) as tmp:
        (tmp / "config.json").write_text("{}")
        (tmp / "sub").mkdir()
        (tmp / "sub" / "w.bin").write_bytes(b"1")
        assert not target.exists()  # invisible until the block ends
    assert (target / "sub" / "w.bin").read_bytes() == b"1"
    with atomic_folder(target) as tmp:
        (tmp / "config.json").write_text('{"v": 2}')
    assert sorted(os.listdir(target)) == ["config.json"] and (target / "config.json").read_text() == '{"v": 2}'
    assert os.listdir(tmp_path / "models") == ["drafter"]  # no temp or moved-aside folder left


def test_atomic_folder_failure_keeps_the_old_folder(tmp_path):
    target = tmp_path / "drafter"
    with atomic_folder(target) as tmp:
        (tmp / "weights").write_bytes(b"good")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_folder(target) as tmp:
            (tmp / "weights").write_bytes(b"half")
            raise RuntimeError("disk full")
    assert (target / "weights").read_bytes() == b"good"
    assert os.listdir(tmp_path) == ["drafter"]


def test_exchange_paths_swaps_two_folders_in_one_step(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "which").write_text("a")
    (b / "which").write_text("b")
    assert files.exchange_paths(a, b)  # Linux with renameat2, as on every machine this project runs on
    assert (a / "which").read_text() == "b" and (b / "which").read_text() == "a"
    with pytest.raises(FileNotFoundError):
        files.exchange_paths(a, tmp_path / "missing")


def test_replacing_a_folder_never_leaves_the_name_empty(tmp_path, monkeypatch):
    target = tmp_path / "drafter"
    with atomic_folder(target) as tmp:
        (tmp / "weights").write_bytes(b"v1")
    real_replace = os.replace

    def replace(src, dst):  # any rename of the published folder itself would open a gap
        assert os.fspath(dst) != os.fspath(target) and os.fspath(src) != os.fspath(target)
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    with atomic_folder(target) as tmp:
        (tmp / "weights").write_bytes(b"v2")
    assert (target / "weights").read_bytes() == b"v2" and os.listdir(tmp_path) == ["drafter"]


def test_folder_publish_falls_back_where_no_exchange_exists(tmp_path, monkeypatch):
    target = tmp_path / "drafter"
    with atomic_folder(target) as tmp:
        (tmp / "weights").write_bytes(b"v1")
    monkeypatch.setattr(files, "exchange_paths", lambda a, b: False)
    with atomic_folder(target) as tmp:
        (tmp / "weights").write_bytes(b"v2")
    assert (target / "weights").read_bytes() == b"v2" and os.listdir(tmp_path) == ["drafter"]
