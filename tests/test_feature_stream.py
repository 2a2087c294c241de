"""The bootstrap's text feature pass beside its SFT (serve/feature_stream.py, bootstrap.overlap_features),
on the embedded target: a real producer process, real chunks, the real SFT loop."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from online_opd.config import load_config
from online_opd.models.target import ensure_embedded_target
from online_opd.train.sequences import TrainSequence, compute_aux_hidden, load_sequences
from serve import feature_stream
from serve.feature_stream import END_FILE, FeatureStream, chunk_name, chunk_range, chunks, produce
from tests.serving import ROOT

LAYERS = (1, 3)


def _text_only(*overrides: str):
    return load_config(ROOT / "configs/test-tiny.yaml", ["bootstrap.rollouts=false", "bootstrap.text_max_tokens=12",
                                                         "bootstrap.overlap_features=true", *overrides])


@contextmanager
def _torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def two_threads():
    """The test process runs torch on one thread (conftest); a stream splits two."""
    with _torch_threads(2):
        yield


@pytest.fixture
def one_thread():
    """The producer computes on one thread; a reference computed on as many is bit-identical."""
    with _torch_threads(1):
        yield


def test_chunk_names_round_trip(tmp_path):
    assert chunk_name(8, 16) == "chunk-000008-000016.safetensors"
    assert chunk_range(tmp_path / chunk_name(8, 16)) == (8, 16)
    for other in ("chunk-8.safetensors", "chunk-a-b.safetensors", ".tmp-8.safetensors", "end.json",
                  "chunk-000008-000016.bin"):
        assert chunk_range(tmp_path / other) is None
    (tmp_path / chunk_name(8, 16)).touch()
    (tmp_path / chunk_name(0, 8)).touch()
    (tmp_path / ".tmp-16.safetensors").touch()  # half written: never read
    assert [(a, b) for a, b, _ in chunks(tmp_path)] == [(0, 8), (8, 16)]


@pytest.mark.slow
def test_the_producer_writes_the_sequential_features_and_a_rerun_resumes_after_its_last_chunk(tmp_path, one_thread,
                                                                                              monkeypatch):
    """In order, in chunks, the features and labels of compute_aux_hidden itself; a rerun recomputes only
    the chunks that are missing and leaves the others alone."""
    from serve.pipeline import load_tokenizer, text_sequences

    monkeypatch.setattr(feature_stream, "CHUNK_SEQUENCES", 2)
    cfg = _text_only("bootstrap.text_conversations=5")
    target = ensure_embedded_target(progress=False)
    config = cfg.model_dump(mode="json")
    produce(config, str(target), str(tmp_path), LAYERS, None, 1)
    assert [(a, b) for a, b, _ in chunks(tmp_path)] == [(0, 2), (2, 4), (4, 5)]
    end = json.loads((tmp_path / END_FILE).read_text())
    assert end["reason"] == "done" and end["sequences"] == 5 and end["error"] is None

    from online_opd.models.target_model import TargetModel
    reference = text_sequences(cfg, load_tokenizer(target))
    compute_aux_hidden(TargetModel.from_pretrained(target, dtype=torch.float32), reference, LAYERS,
                       with_labels=True, progress=False)
    streamed = [s for _, _, path in chunks(tmp_path) for s in load_sequences(path, LAYERS)]
    assert len(streamed) == len(reference) == 5
    for got, want in zip(streamed, reference):
        assert torch.equal(got.tokens, want.tokens) and got.prompt_len == want.prompt_len
        assert torch.equal(got.aux_hidden, want.aux_hidden) and torch.equal(got.labels, want.labels)

    first = tmp_path / chunk_name(0, 2)
    kept = first.stat().st_mtime_ns
    for _, end_index, path in chunks(tmp_path):
        if end_index > 2:
            path.unlink()
    produce(config, str(target), str(tmp_path), LAYERS, None, 1)
    assert [(a, b) for a, b, _ in chunks(tmp_path)] == [(0, 2), (2, 4), (4, 5)]
    assert first.stat().st_mtime_ns == kept
    assert json.loads((tmp_path / END_FILE).read_text())["sequences"] == 3  # this run's: 2 to 5
    again = [s for _, _, path in chunks(tmp_path) for s in load_sequences(path, LAYERS)]
    assert all(torch.equal(a.aux_hidden, b.aux_hidden) for a, b in zip(again, streamed))


@pytest.mark.slow
def test_a_producer_at_its_deadline_stops_between_conversations(tmp_path):
    cfg = _text_only("bootstrap.text_conversations=5")
    produce(cfg.model_dump(mode="json"), str(ensure_embedded_target(progress=False)), str(tmp_path),
            LAYERS, time.monotonic() - 1.0, 1)
    assert chunks(tmp_path) == []
    assert json.loads((tmp_path / END_FILE).read_text())["reason"] == "deadline"


@pytest.mark.slow
def test_closing_the_stream_stops_the_producer_and_gives_the_threads_back(tmp_path, two_threads):
    """The trainer stops early: the producer ends at its next chunk, and the trainer runs on its threads
    again."""
    threads = torch.get_num_threads()
    cfg = _text_only("bootstrap.text_conversations=400")
    stream = FeatureStream.start(cfg, ensure_embedded_target(progress=False), tmp_path, LAYERS, deadline=None)
    try:
        assert torch.get_num_threads() == 1  # the producer has the other
        first = stream.wait_first()
        assert first and all(isinstance(s, TrainSequence) and s.labels is not None for s in first)
    finally:
        summary = stream.close()
    assert not stream.process.is_alive()
    assert summary["reason"] == "stopped" and summary["error"] is None
    # read: what the trainer took before it stopped; the chunks the producer finished meanwhile stay on disk
    assert 0 < summary["sequences_read"] <= summary["sequences"] < 400
    assert summary["sequences"] == sum(b - a for a, b, _ in chunks(tmp_path / "text_stream"))
    assert torch.get_num_threads() == threads


@pytest.mark.slow
def test_a_producer_that_fails_is_reported_and_the_trainer_keeps_its_threads(tmp_path, two_threads):
    threads = torch.get_num_threads()
    cfg = _text_only("bootstrap.text_conversations=3")
    stream = FeatureStream.start(cfg, tmp_path / "no-such-model", tmp_path, LAYERS, deadline=None)
    assert stream.wait_first() == []
    summary = stream.close()
    assert summary["reason"] == "error" and "no-such-model" in summary["error"]
    assert torch.get_num_threads() == threads


@pytest.mark.slow
def test_an_overlapped_bootstrap_trains_on_its_growing_pool(tmp_path, two_threads):
    """Text only: the SFT waits for the first chunk, its pool grows between steps up to every conversation,
    and the manifest records the stream; a rerun in the folder reuses the chunks."""
    from online_opd.models.drafters.checkpoint import read_manifest
    from serve.pipeline import bootstrap

    cfg = _text_only("bootstrap.text_conversations=20", "bootstrap.num_steps=40", "bootstrap.checkpoint_every=100",
                     "bootstrap.num_threads=2")
    drafter = bootstrap(cfg, tmp_path, progress=False)
    metrics = read_manifest(drafter)["metrics"]
    stream = metrics["feature_stream"]
    assert stream["reason"] == "done" and stream["sequences"] == stream["sequences_read"] == 20
    assert metrics["num_text_sequences"] == metrics["num_sequences"] == 20
    pool = [json.loads(line)["pool_sequences"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(pool) == 40 and pool == sorted(pool) and 1 <= pool[0] and pool[-1] <= 20
    assert sum(b - a for a, b, _ in chunks(tmp_path / "text_stream")) == 20

    rerun = Path(tmp_path / "rerun")
    rerun.mkdir()
    (rerun / "text_stream").mkdir()
    for _, _, path in chunks(tmp_path / "text_stream"):
        (rerun / "text_stream" / path.name).write_bytes(path.read_bytes())
    again = read_manifest(bootstrap(cfg, rerun, progress=False))["metrics"]["feature_stream"]
    assert again["sequences"] == 0 and again["sequences_read"] == 20  # nothing left to compute


def test_when_a_bootstrap_does_not_overlap(tmp_path, caplog, two_threads):
    from serve.pipeline import TEXT_SEQUENCES_FILE, _overlaps

    assert not _overlaps(_text_only("bootstrap.text_conversations=3", "bootstrap.overlap_features=false"),
                         tmp_path)
    with caplog.at_level("INFO", logger="serve.pipeline"):
        assert not _overlaps(_text_only("bootstrap.text_conversations=3", "bootstrap.num_threads=1"), tmp_path)
        assert "one torch thread" in caplog.text
        assert not _overlaps(_text_only("bootstrap.text_conversations=4", "bootstrap.num_workers=2",
                                        "bootstrap.sequences_per_step=2", "bootstrap.num_threads=2"), tmp_path)
        assert "num_workers=2" in caplog.text
        (tmp_path / TEXT_SEQUENCES_FILE).touch()
        assert not _overlaps(_text_only("bootstrap.text_conversations=3", "bootstrap.num_threads=2"), tmp_path)
        assert "already computed" in caplog.text
    (tmp_path / TEXT_SEQUENCES_FILE).unlink()
    assert _overlaps(_text_only("bootstrap.text_conversations=3", "bootstrap.num_threads=2"), tmp_path)
