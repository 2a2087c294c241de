"""The versioned drafter registry: real tiny drafters, real files, real threads."""

from __future__ import annotations

import argparse
import json
import shutil
import threading
from pathlib import Path

import pytest

from online_opd.models.drafters.checkpoint import (
    CONFIG_FILE,
    MANIFEST_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    load_drafter,
    record_manifest_metrics,
    save_drafter,
    sha256_file,
    verify_checkpoint,
)
from online_opd.release.registry import CurrentMovedError, DrafterRegistry, RegistryError
from serve import drafters_cli
from tests.tiny import tiny_drafter, tiny_eagle3_drafter, tiny_target


@pytest.fixture(scope="module")
def drafter():
    return tiny_drafter(tiny_target(), seed=1)


@pytest.fixture
def reg(tmp_path: Path) -> DrafterRegistry:
    return DrafterRegistry(tmp_path / "registry")


def test_publish_allocates_increasing_versions_as_candidates(reg, drafter):
    assert reg.list() == [] and reg.current() is None and reg.history() == []
    a = reg.publish(drafter, step=10, metrics={"loss": 1.5})
    b = reg.publish(drafter, parent=a.version, step=20)
    assert (a.version, b.version) == ("v0001", "v0002")
    assert b.parent == "v0001" and b.step == 20 and a.metrics == {"loss": 1.5}
    assert a.status == "candidate" and not a.is_current and a.method == "dflash"
    assert [v.version for v in reg.list()] == ["v0001", "v0002"]
    assert reg.weights_sha256("v0002") == verify_checkpoint(reg.path("v0002"))["files"][WEIGHTS_FILE]
    assert load_drafter(reg.path("v0001")).state_dict().keys() == drafter.state_dict().keys()
    assert [e["event"] for e in reg.history()] == ["publish", "publish"]
    # only finished versions are visible: no staging folders left behind
    assert sorted(p.name for p in reg.versions_dir.iterdir()) == ["v0001", "v0002"]


def test_publish_copies_a_verified_checkpoint_folder(reg, drafter, tmp_path):
    src = save_drafter(drafter, tmp_path / "trained", step=7, metrics={"acc": 0.5})
    info = reg.publish(src, metrics={"gate": 3.0})
    assert info.version == "v0001" and info.step == 7 and info.metrics == {"acc": 0.5, "gate": 3.0}
    verify_checkpoint(info.path)
    with pytest.raises(RegistryError, match="unknown drafter version 'v0042'"):
        reg.publish(src, parent="v0042")
    (src / WEIGHTS_FILE).write_bytes(b"garbage")
    with pytest.raises(RegistryError, match="sha256 of model.safetensors"):
        reg.publish(src)
    with pytest.raises(RegistryError, match="not a drafter checkpoint"):
        reg.publish(tmp_path / "nowhere")
    assert [v.version for v in reg.list()] == ["v0001"]


def test_recorded_figures_travel_with_the_checkpoint_into_the_registry(reg, drafter, tmp_path):
    """`online-opd eval --record` writes metrics.eval into a checkpoint's manifest: the weights and
    their hashes stay, and publishing the folder carries the figures into the version."""
    src = save_drafter(drafter, tmp_path / "boot", step=3, metrics={"objective": "sft"})
    before = verify_checkpoint(src)
    served = {"tau": 1.5, "acceptance_rate_per_position": [0.4, 0.1], "num_drafts": 300}
    after = record_manifest_metrics(src, "eval", served)
    assert after == {**before, "metrics": {"objective": "sft", "eval": served}} == verify_checkpoint(src)
    assert reg.publish(src).metrics == {"objective": "sft", "eval": served}
    with pytest.raises(CheckpointError, match="no manifest.json to record 'eval'"):
        record_manifest_metrics(tmp_path / "nowhere", "eval", served)


def _drop_manifest_method(folder: Path, config: dict | None = None) -> Path:
    """A checkpoint folder whose manifest does not name its method (optionally with another config)."""
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    del manifest["method"]
    if config is not None:
        (folder / CONFIG_FILE).write_text(json.dumps(config))
        manifest["files"][CONFIG_FILE] = sha256_file(folder / CONFIG_FILE)
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    return folder


def test_publish_reads_the_method_from_config_json_when_the_manifest_lacks_it(reg, tmp_path):
    eagle3 = _drop_manifest_method(save_drafter(tiny_eagle3_drafter(), tmp_path / "eagle3"))
    assert reg.publish(eagle3).method == "eagle3"
    config = json.loads((eagle3 / CONFIG_FILE).read_text())
    foreign = _drop_manifest_method(save_drafter(tiny_eagle3_drafter(), tmp_path / "foreign"),
                                    dict(config, architectures=["LlamaForCausalLM"]))
    with pytest.raises(RegistryError, match=r"cannot publish .*foreign: unsupported drafter architectures "
                                            r"\['LlamaForCausalLM'\].*'DFlashDraftModel'"):
        reg.publish(foreign)
    assert [v.version for v in reg.list()] == ["v0001"]


def test_promote_switches_current_and_rollback_returns_to_previous(reg, drafter):
    v1, v2, v3 = (reg.publish(drafter).version for _ in range(3))
    reg.promote(v1, reason="bootstrap")
    assert reg.current().version == v1 and reg.get(v1).status == "promoted"
    reg.promote(v2, reason="gate passed")
    assert reg.current().version == v2 and not reg.get(v1).is_current
    reg.promote(v3)
    back = reg.rollback("acceptance dropped")
    assert back.version == v2 and back.is_current
    assert reg.get(v3).status == "bad" and "acceptance dropped" in reg.get(v3).status_reason
    assert reg.rollback("again").version == v1  # v3 is bad, so v2's predecessor is next
    with pytest.raises(RegistryError, match=f"cannot roll back from {v1}.*Nothing was changed"):
        reg.rollback("no more")
    assert reg.current().version == v1 and reg.get(v1).status == "promoted"
    events = [(e["event"], e["version"]) for e in reg.history()]
    assert ("rollback", v2) in events and ("mark_bad", v3) in events


def test_promote_refuses_bad_and_unknown_versions(reg, drafter):
    v1 = reg.publish(drafter).version
    reg.mark_bad(v1, "diverged in training")
    with pytest.raises(RegistryError, match=rf"cannot promote {v1}: it is marked bad \(diverged"):
        reg.promote(v1)
    with pytest.raises(RegistryError, match="unknown drafter version 'v0009'"):
        reg.promote("v0009")
    with pytest.raises(RegistryError, match="unknown drafter version"):
        reg.get("../versions")
    with pytest.raises(RegistryError, match="no current version"):
        reg.rollback("nothing promoted")
    assert reg.current() is None


def test_promote_refuses_tampered_checkpoint(reg, drafter):
    v1, v2 = reg.publish(drafter).version, reg.publish(drafter).version
    reg.promote(v1)
    weights = reg.path(v2) / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    weights.write_bytes(bytes(data))
    with pytest.raises(RegistryError, match=f"cannot promote {v2}: checkpoint failed verification.*sha256"):
        reg.promote(v2)
    assert reg.current().version == v1


def test_concurrent_publishes_get_distinct_versions(tmp_path, drafter):
    root = tmp_path / "registry"
    results: list[str] = []
    barrier = threading.Barrier(2)

    def publish() -> None:
        registry = DrafterRegistry(root)  # one instance per "process"
        barrier.wait()
        for _ in range(3):
            results.append(registry.publish(drafter).version)

    threads = [threading.Thread(target=publish) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [f"v{i:04d}" for i in range(1, 7)]
    assert len(DrafterRegistry(root).list()) == 6


def test_set_metrics_keeps_hashes_valid_and_loses_no_concurrent_update(reg, drafter):
    v1 = reg.publish(drafter, metrics={"loss": 2.0}).version
    sha = reg.weights_sha256(v1)

    def write(prefix: str) -> None:
        for i in range(5):
            reg.set_metrics(v1, f"{prefix}{i}", i / 10)

    threads = [threading.Thread(target=write, args=(p,)) for p in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    info = reg.set_metrics(v1, "gate", {"acceptance_length": 2.5, "passed": True})
    assert info.metrics["gate"] == {"acceptance_length": 2.5, "passed": True} and info.metrics["loss"] == 2.0
    assert {f"{p}{i}" for p in "ab" for i in range(5)} <= set(info.metrics)
    verify_checkpoint(info.path)
    reg.promote(v1)  # promote re-verifies the hashes
    assert reg.weights_sha256(v1) == sha
    with pytest.raises(RegistryError, match="not JSON"):
        reg.set_metrics(v1, "bad", object())


def test_current_is_replaced_atomically(reg, drafter):
    versions = [reg.publish(drafter).version for _ in range(2)]
    reg.promote(versions[0])
    current_file = reg.root / "CURRENT"
    seen: set[str] = set()
    torn: list[str] = []
    stop = threading.Event()

    def poll() -> None:  # what the server's reloader does, in a tight loop
        while not stop.is_set():
            text = current_file.read_text()
            try:
                seen.add(json.loads(text)["version"])
            except (json.JSONDecodeError, KeyError):
                torn.append(text)

    reader = threading.Thread(target=poll)
    reader.start()
    try:
        for i in range(20):
            reg.promote(versions[i % 2], reason=f"flip {i}")
    finally:
        stop.set()
        reader.join()
    assert torn == [] and seen <= set(versions)
    pointer = json.loads(current_file.read_text())
    assert pointer["version"] == versions[1] and pointer["reason"] == "flip 19" and pointer["since"] > 0
    leftovers = [p.name for p in reg.root.rglob(".*tmp*")] + [p.name for p in reg.root.rglob(".*staging*")]
    assert leftovers == []


def _cli(argv: list[str], capsys) -> tuple[int, dict | None]:
    parser = argparse.ArgumentParser()
    drafters_cli.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    assert args.command == "drafters"
    rc = drafters_cli.run(args)
    out = capsys.readouterr().out
    return rc, (json.loads(out) if out.strip() else None)


def test_cli_list_show_promote_rollback(tmp_path, drafter, capsys, monkeypatch):
    root = tmp_path / "registry"
    src = save_drafter(drafter, tmp_path / "ckpt", step=3)
    rc, out = _cli(["drafters", "publish", str(src), "--registry", str(root)], capsys)
    assert rc == 0 and out["version"] == "v0001" and out["status"] == "candidate" and out["step"] == 3
    monkeypatch.setenv("ONLINE_OPD_REGISTRY", str(root))  # the other actions find it via the env
    _cli(["drafters", "publish", str(src)], capsys)

    rc, out = _cli(["drafters", "promote", "v0001", "--reason", "first"], capsys)
    assert rc == 0 and out["is_current"] and out["status"] == "promoted"
    _cli(["drafters", "promote", "v0002"], capsys)
    rc, out = _cli(["drafters", "list"], capsys)
    assert rc == 0 and out["current"] == "v0002"
    assert [v["version"] for v in out["versions"]] == ["v0001", "v0002"]

    rc, out = _cli(["drafters", "show", "v0002"], capsys)
    assert rc == 0 and out["weights_sha256"] == DrafterRegistry(root).weights_sha256("v0002")
    assert out["path"] == str(root / "versions" / "v0002")

    rc, out = _cli(["drafters", "rollback", "--reason", "live acceptance dropped"], capsys)
    assert rc == 0 and out["from"] == "v0002" and out["current"]["version"] == "v0001"
    rc, out = _cli(["drafters", "promote", "v0002"], capsys)
    assert rc == 2 and out is None  # bad: refused, error logged
    rc, out = _cli(["drafters", "show", "v0099"], capsys)
    assert rc == 2
    rc, out = _cli(["drafters", "history"], capsys)
    events = [e["event"] for e in out["events"]]
    assert events == ["publish", "publish", "promote", "promote", "mark_bad", "rollback"]


def test_rollback_of_a_checked_version_refuses_once_current_moved(reg, drafter):
    v1, v2, v3 = (reg.publish(drafter).version for _ in range(3))
    reg.promote(v1)
    reg.promote(v2)  # the reloader starts checking v2 live ...
    reg.promote(v3)  # ... and v3 is promoted meanwhile
    events = len(reg.history())
    with pytest.raises(CurrentMovedError, match=f"not rolling back {v2}: CURRENT is {v3} now.*Nothing was changed"):
        reg.rollback("v2 failed its live check", expected_current=v2)
    assert reg.current().version == v3 and len(reg.history()) == events
    assert reg.get(v2).status == reg.get(v3).status == "promoted"
    assert reg.rollback("v3 failed", expected_current=v3).version == v2
    assert reg.get(v3).status == "bad"


def test_check_repairs_a_current_left_on_a_bad_version(reg, drafter):
    assert reg.check() is None  # no CURRENT yet: nothing to check
    v1, v2 = (reg.publish(drafter).version for _ in range(2))
    reg.promote(v1)
    reg.promote(v2)
    assert reg.check() is None
    reg.mark_bad(v2, "rolled back: live tau fell")  # a rollback that crashed before writing CURRENT
    repair = reg.check()
    assert repair == {"from": v2, "to": v1, "problem": "is marked bad (rolled back: live tau fell)"}
    assert reg.current().version == v1
    last = reg.history()[-1]
    assert (last["event"], last["version"], last["from"]) == ("repair", v1, v2)
    assert reg.check() is None


def test_check_repairs_a_missing_or_corrupt_current_and_refuses_when_nothing_is_good(reg, drafter):
    v1, v2, v3 = (reg.publish(drafter).version for _ in range(3))
    for version in (v1, v2, v3):
        reg.promote(version)
    shutil.rmtree(reg.path(v3))
    repair = reg.check()
    assert (repair["from"], repair["to"]) == (v3, v2) and "unknown drafter version 'v0003'" in repair["problem"]
    weights = reg.path(v2) / WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-8] + b"tampered")
    repair = reg.check()
    assert (repair["from"], repair["to"]) == (v2, v1) and "sha256 of model.safetensors" in repair["problem"]
    reg.mark_bad(v1, "by hand")
    with pytest.raises(RegistryError, match=f"CURRENT of .* is {v1}, which is marked bad .*promote one by hand"):
        reg.check()
    assert reg.current().version == v1  # nothing changed


def test_check_repairs_a_current_that_is_not_a_json_pointer(reg, drafter):
    v1, v2, v3 = (reg.publish(drafter).version for _ in range(3))
    reg.promote(v1)
    reg.promote(v2)  # v3 stays a candidate: never made current, never a repair target
    for garbage in ('{"version": "v00', "", '["v0002"]'):
        (reg.root / "CURRENT").write_text(garbage)
        with pytest.raises(RegistryError, match="CURRENT: "):
            reg.current()
        repair = reg.check()
        assert (repair["from"], repair["to"]) == (None, v2) and repair["problem"].startswith("is unreadable")
        assert reg.current().version == v2
    assert [e["event"] for e in reg.history()].count("repair") == 3 and reg.get(v3).status == "candidate"


def test_retention_keeps_versions_ever_current_and_the_newest_others(tmp_path, drafter):
    with pytest.raises(RegistryError, match="keep_unpromoted=0"):
        DrafterRegistry(tmp_path / "r", keep_unpromoted=0)
    reg = DrafterRegistry(tmp_path / "registry", keep_unpromoted=2)
    v1 = reg.publish(drafter).version
    reg.promote(v1)
    for _ in range(2):
        reg.reject(reg.publish(drafter).version, "gate failed")  # v2, v3
    reg.publish(drafter)  # v4: three never-current versions, the oldest goes
    assert [v.version for v in reg.list()] == ["v0001", "v0003", "v0004"]
    reg.promote(reg.publish(drafter).version)  # v5 pushes v3 out before its promote
    reg.mark_bad("v0004", "never served, never to be")
    reg.reject(reg.publish(drafter).version, "gate failed")  # v6: v4 and v6 are the two kept
    assert [v.version for v in reg.list()] == ["v0001", "v0004", "v0005", "v0006"]
    pruned = [e["version"] for e in reg.history() if e["event"] == "prune"]
    assert pruned == ["v0002", "v0003"]
    assert not (reg.status_dir / "v0002.json").exists() and not (reg.versions_dir / "v0002").exists()
    assert reg.publish(drafter).version == "v0007"  # names are never reused
    assert reg.rollback("v5 fell live", expected_current="v0005").version == "v0001"
    leftovers = [p.name for p in reg.versions_dir.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_cli_finds_the_servers_registry_from_the_config_and_checks_it(tmp_path, drafter, capsys, monkeypatch):
    monkeypatch.delenv("ONLINE_OPD_REGISTRY", raising=False)
    config = tmp_path / "serve.yaml"
    config.write_text(f"serve:\n  run_dir: {tmp_path / 'srv'}\n")
    reg = DrafterRegistry(tmp_path / "srv" / "registry")  # where `online-opd serve -c serve.yaml` keeps it
    v1, v2 = (reg.publish(drafter).version for _ in range(2))
    reg.promote(v1)
    reg.promote(v2)
    reg.mark_bad(v2, "crashed mid-rollback")
    rc, out = _cli(["drafters", "list", "-c", str(config)], capsys)
    assert rc == 0 and out["registry"] == str(reg.root) and out["current"] == v2
    rc, out = _cli(["drafters", "check", "-c", str(config)], capsys)
    assert rc == 0 and out["current"] == v1 and out["repaired"]["from"] == v2
    rc, out = _cli(["drafters", "list"], capsys)  # no config: the server's default folder
    assert rc == 0 and out["registry"] == str(Path("runs/serve/registry"))
