"""The versioned drafter registry: real tiny drafters, real files, real threads."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path

import pytest

from online_opd.models.drafters.checkpoint import WEIGHTS_FILE, load_drafter, save_drafter, verify_checkpoint
from online_opd.release.registry import DrafterRegistry, RegistryError
from serve import drafters_cli
from tests.tiny import tiny_drafter, tiny_target


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
