"""Drafter checkpoints in the folder format vLLM loads as a speculative model.

A checkpoint folder holds `config.json` (vLLM/HF config of the drafter),
`model.safetensors` (the drafter's own tensors only: the target's embeddings
and LM head are shared, never stored, except the rows of a reduced draft
vocabulary, `lm_head.weight` with its `d2t` map) and `manifest.json` (version, parent
version, sha256 of each file, training step, free-form metrics). Folders are
written to a temporary sibling and renamed into place, so a half-written
checkpoint is never visible (``online_opd.files.atomic_folder``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from online_opd.files import atomic_folder, atomic_write_json, sha256_file
from online_opd.models.drafters.registry import drafter_class_for_config

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"


class CheckpointError(ValueError):
    """A drafter checkpoint is missing, corrupt or does not fit its config."""


def save_drafter(
    drafter: nn.Module,
    path: str | Path,
    *,
    version: str | None = None,
    parent_version: str | None = None,
    step: int = 0,
    metrics: dict | None = None,
) -> Path:
    """Write `drafter` to the folder `path` atomically (``files.atomic_folder``); returns the path."""
    path = Path(path)
    with atomic_folder(path) as tmp:
        write_checkpoint(drafter, tmp, version=version or path.name, parent_version=parent_version,
                         step=step, metrics=metrics)
    return path


def write_checkpoint(drafter: nn.Module, folder: Path, *, version: str, parent_version: str | None = None,
                     step: int = 0, metrics: dict | None = None) -> None:
    """Write the checkpoint's three files into the existing folder `folder` (not atomic on its own)."""
    tensors = {k: v.detach().to("cpu", torch.float32 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in drafter.state_dict().items()}  # integer tensors (d2t) keep their dtype
    save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(drafter.cfg.to_hf_config(), indent=2))
    manifest = {
        "version": version,
        "parent_version": parent_version,
        "method": drafter.method,
        "step": step,
        "files": {f: sha256_file(folder / f) for f in (CONFIG_FILE, WEIGHTS_FILE)},
        "metrics": metrics or {},
    }
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))


def read_manifest(path: str | Path) -> dict:
    file = Path(path) / MANIFEST_FILE
    if not file.exists():
        return {}
    return json.loads(file.read_text())


def record_manifest_metrics(path: str | Path, key: str, figures: dict) -> dict:
    """Set ``metrics[key] = figures`` in the checkpoint's manifest (written atomically; weights and
    their hashes untouched); returns the new manifest."""
    file = Path(path) / MANIFEST_FILE
    if not file.exists():
        raise CheckpointError(f"{path}: no {MANIFEST_FILE} to record {key!r} figures in")
    manifest = json.loads(file.read_text())
    manifest["metrics"] = {**(manifest.get("metrics") or {}), key: figures}
    atomic_write_json(file, manifest)
    return manifest


def load_drafter(path: str | Path, *, verify_hashes: bool = True) -> nn.Module:
    """Build a drafter from a checkpoint folder, validating every tensor."""
    path = Path(path)
    if not (path / CONFIG_FILE).exists() or not (path / WEIGHTS_FILE).exists():
        raise CheckpointError(f"{path}: not a drafter checkpoint (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    if verify_hashes:
        verify_checkpoint(path)
    hf_config = json.loads((path / CONFIG_FILE).read_text())
    cls = drafter_class_for_config(hf_config)
    drafter = cls(cls.config_cls.from_hf_config(hf_config))
    try:
        tensors = load_file(path / WEIGHTS_FILE)
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise CheckpointError(f"{path / WEIGHTS_FILE}: unreadable ({exc})") from exc
    load_state_checked(drafter, tensors, source=str(path))
    return drafter


def load_state_checked(drafter: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy `tensors` into `drafter`; errors name the missing/extra/mis-shaped tensor."""
    check_tensors(drafter.state_dict(), tensors, source)
    if "d2t" in tensors:
        check_d2t(tensors["d2t"], drafter.cfg.vocab_size, source)
    drafter.load_state_dict(tensors, strict=True)


def check_d2t(d2t: torch.Tensor, vocab_size: int, source: str) -> None:
    """A reduced drafter's d2t must map its draft ids to ascending, distinct target ids."""
    from online_opd.models.drafters.layers import check_draft_vocab

    try:
        check_draft_vocab(torch.arange(len(d2t)) + d2t, len(d2t), vocab_size)
    except ValueError as exc:
        raise CheckpointError(f"{source}: tensor 'd2t': {exc}") from exc


#: Weight dtypes a drafter checkpoint may carry (float8 and others are refused before any check runs on them).
LOADABLE_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_tensors(expected: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], source: str) -> None:
    """Names, shapes, dtypes and finiteness of `tensors` against `expected` (a state dict; meta tensors do)."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {missing}")
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) {unexpected}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(expected[name].shape)}"
            )
        if expected[name].is_floating_point() != (tensor.dtype in LOADABLE_FLOAT_DTYPES):
            raise CheckpointError(
                f"{source}: tensor {name!r} has dtype {tensor.dtype}; expected "
                + ("one of float32, float16, bfloat16" if expected[name].is_floating_point()
                   else str(expected[name].dtype))
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise CheckpointError(f"{source}: tensor {name!r} has non-finite values")


def verify_checkpoint(path: str | Path) -> dict:
    """Check the manifest's sha256 of every file; returns the manifest."""
    path = Path(path)
    manifest = read_manifest(path)
    for name, digest in manifest.get("files", {}).items():
        file = path / name
        if not file.exists():
            raise CheckpointError(f"{path}: file {name} listed in the manifest is missing")
        actual = sha256_file(file)
        if actual != digest:
            raise CheckpointError(f"{path}: sha256 of {name} is {actual[:12]}…, manifest says {digest[:12]}…")
    return manifest
