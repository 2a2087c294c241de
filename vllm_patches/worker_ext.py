"""Worker extension (``--worker-extension-cls vllm_patches.worker_ext.OnlineOPDWorkerExtension``).

vLLM mixes this class into every worker; the server calls its methods with
``engine_client.collective_rpc(name, args=...)``, which runs them between
engine steps. Methods return plain dicts and never raise: a failed reload
must leave the engine serving on its previous drafter.

Hot reload (docs/architecture.md#hot-reload-on-the-cpu-backend): the drafter is reloaded through its own
``load_weights`` (DFlash rebuilds its fused context K/V buffers there; a bare
``param.copy_`` would leave them stale) with the drafter's tensors only: the
shared embeddings and LM head are never sent. On the CPU backend, vLLM repacks
every unquantized linear weight after loading and leaves ``layer.weight`` empty;
those parameters are registered again at full size before ``load_weights`` and
repacked afterwards with the layer's own ``process_weights_after_loading``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from online_opd.files import sha256_file
from online_opd.models.drafters.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    CheckpointError,
    check_d2t,
    check_tensors,
    read_manifest,
)
from online_opd.models.drafters.registry import drafter_class_for_config

logger = logging.getLogger("online_opd.reload")

# config.json keys that do not change the drafter's shapes or computation
_NON_STRUCTURAL = {"_name_or_path", "transformers_version", "torch_dtype", "dtype"}
_SHARED = ("embed_tokens", "lm_head")


class ReloadError(ValueError):
    """A checkpoint was refused (hash, config, tensors) or could not be loaded."""


def checkpoint_version(path: Path) -> str:
    return str(read_manifest(path).get("version") or path.name)


def verify_for_reload(path: Path, sha256: str | None) -> dict:
    """Every check that needs no serving model; runs in the API server, before the reload RPC.

    Checks the weights file's sha256 (when given) and the manifest's hashes, that
    config.json is valid, and every tensor's name, shape and finiteness against the
    drafter architecture of that config (via the trainer's own module, so the two
    cannot drift). Returns the ``verified`` fingerprint ``online_opd_reload`` takes:
    the weights file's sha256, size and mtime, so the worker only has to ``stat`` it.
    """
    hf_config, weights_sha256 = _check_files(path, sha256)
    _check_tensors(path, hf_config, _load_tensors(path / WEIGHTS_FILE))
    return {"sha256": weights_sha256, **_weights_stat(path)}


def read_verified_tensors(path: Path, verified: dict, serving_config: dict | None) -> dict[str, torch.Tensor]:
    """The worker's part after `verify_for_reload`: the weights file is the one verified (same size
    and mtime), its config matches the serving drafter's structure; then read the tensors."""
    if not (path / WEIGHTS_FILE).is_file():
        raise ReloadError(f"{path}: {WEIGHTS_FILE} is gone since it was verified")
    stat = _weights_stat(path)
    if any(stat[k] != verified.get(k) for k in stat):
        raise ReloadError(f"{path / WEIGHTS_FILE} changed since it was verified (sha256 "
                          f"{str(verified.get('sha256'))[:16]}…): {verified} -> {stat}; reload again")
    _check_structure(path, _read_config(path), serving_config)
    return _load_tensors(path / WEIGHTS_FILE)


def read_checked_tensors(path: Path, sha256: str | None, serving_config: dict | None) -> dict[str, torch.Tensor]:
    """All checks in one place (`verify_for_reload` plus the structure check); returns the tensors."""
    hf_config, _ = _check_files(path, sha256)
    _check_structure(path, hf_config, serving_config)
    tensors = _load_tensors(path / WEIGHTS_FILE)
    _check_tensors(path, hf_config, tensors)
    return tensors


def _check_files(path: Path, sha256: str | None) -> tuple[dict, str]:
    """Both files exist and match the manifest's (and the caller's) sha256; returns config.json and
    the weights file's sha256."""
    weights, config_file = path / WEIGHTS_FILE, path / CONFIG_FILE
    if not weights.is_file() or not config_file.is_file():
        raise ReloadError(f"{path}: not a drafter checkpoint (needs {CONFIG_FILE} and {WEIGHTS_FILE})")
    expected = read_manifest(path).get("files", {})
    actual = {name: sha256_file(path / name) for name in (CONFIG_FILE, WEIGHTS_FILE)}  # each hashed once
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        for want, what in ((expected.get(name), "the manifest"), (sha256 if name == WEIGHTS_FILE else None,
                                                                  "the caller")):
            if want and actual[name] != want:
                raise ReloadError(f"{path}: sha256 of {name} is {actual[name][:16]}…, {what} says {want[:16]}…")
    return _read_config(path), actual[WEIGHTS_FILE]


def _read_config(path: Path) -> dict:
    try:
        return json.loads((path / CONFIG_FILE).read_text())
    except ValueError as exc:
        raise ReloadError(f"{path / CONFIG_FILE}: not valid JSON ({exc})") from exc


def _check_structure(path: Path, hf_config: dict, serving_config: dict | None) -> None:
    if serving_config is None:
        return
    diff = sorted(k for k in (hf_config.keys() | serving_config.keys()) - _NON_STRUCTURAL
                  if hf_config.get(k) != serving_config.get(k))
    if diff:
        raise ReloadError(f"{path}: config differs from the serving drafter in {diff}; "
                          "a different architecture needs a server restart")


def _load_tensors(weights: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(weights)
    except Exception as exc:
        raise ReloadError(f"{weights}: unreadable ({exc})") from exc


def _check_tensors(path: Path, hf_config: dict, tensors: dict[str, torch.Tensor]) -> None:
    own_head = hf_config.get("draft_vocab_size") not in (None, hf_config.get("vocab_size"))
    shared = [name for name in tensors if any(s in name for s in _SHARED)
              and not (own_head and name == "lm_head.weight")]  # a reduced head is the drafter's own
    if shared:
        raise ReloadError(f"{path}: carries shared target tensors {shared}; hot reload never overwrites them")
    try:
        cls = drafter_class_for_config(hf_config)
        with torch.device("meta"):  # shapes only: no memory for a second copy of the drafter
            module = cls(cls.config_cls.from_hf_config(hf_config))
        check_tensors(module.state_dict(), tensors, str(path))
        if "d2t" in tensors:
            check_d2t(tensors["d2t"], int(hf_config["vocab_size"]), str(path))
    except (CheckpointError, ValueError) as exc:
        raise ReloadError(str(exc)) from exc


def _weights_stat(path: Path) -> dict:
    stat = (path / WEIGHTS_FILE).stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def load_into_serving_model(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Load drafter tensors into vLLM's drafter module through its own ``load_weights``."""
    from vllm.model_executor.layers.linear import LinearBase

    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    for layer in linears:
        weight = getattr(layer, "weight", None)
        if weight is not None and weight.numel() == 0:  # repacked by the CPU backend: restore
            _reregister_weight(layer, weight.device)
    model.load_weights(iter(tensors.items()))
    for layer in linears:
        method = getattr(layer, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(layer)


def _reregister_weight(layer: Any, device: torch.device) -> None:
    loader = getattr(layer, "weight_loader_v2", None)
    from vllm.model_executor.layers.linear import WEIGHT_LOADER_V2_SUPPORTED

    if loader is None or layer.quant_method.__class__.__name__ not in WEIGHT_LOADER_V2_SUPPORTED:
        loader = layer.weight_loader
    in_size = getattr(layer, "input_size_per_partition", layer.input_size)
    with torch.device(device):
        layer.quant_method.create_weights(
            layer=layer, input_size_per_partition=in_size,
            output_partition_sizes=list(layer.output_partition_sizes), input_size=layer.input_size,
            output_size=layer.output_size, params_dtype=layer.params_dtype, weight_loader=loader)


class OnlineOPDWorkerExtension:
    """Methods added to vLLM's worker; ``self`` is the worker."""

    def _online_opd_state(self) -> dict:
        state = getattr(self, "_online_opd", None)
        if state is None:
            spec = self.vllm_config.speculative_config
            path = Path(spec.model) if spec is not None and spec.model else None
            version = checkpoint_version(path) if path is not None and path.is_dir() else None
            config = (json.loads((path / CONFIG_FILE).read_text())
                      if path is not None and (path / CONFIG_FILE).is_file() else None)
            state = self._online_opd = {"path": path, "version": version, "config": config,
                                        "pinned_current": None, "reloads": {"ok": 0, "refused": 0, "failed": 0}}
            from vllm_patches import capture_hooks

            if (cap := capture_hooks.current()) is not None and version is not None:
                cap.version = version
        return state

    def online_opd_reload(self, path: str, sha256: str | None = None, verified: dict | None = None,
                          is_cache_reset: bool = False, pinned_current: str | None = None) -> dict:
        """Hot-load the drafter checkpoint at ``path``; returns {"ok", "version", "seconds", ...}.

        With ``verified`` (`verify_for_reload`'s result, computed by the caller outside the engine
        step) only the weights file's stat and the config are checked here; without it, everything.
        ``is_cache_reset``: the caller paused the engine and reset its prefix cache first (endpoint.py),
        so no drafter K/V of the old weights survive; capture labels blocks pure from the resume on.
        ``pinned_current``: an admin reload pins its drafter until the registry's CURRENT moves from this
        version (``""``: while there is none); every loaded reload sets it, so the reloader's own clears it.
        The pin lives here, beside the version, so every API server of the engine sees it (endpoint.py).
        """
        state = self._online_opd_state()
        start = time.perf_counter()
        ckpt = Path(path)
        previous = state["version"]
        try:
            if self.model_runner.drafter is None or not hasattr(self.model_runner.drafter, "model"):
                raise ReloadError("this engine serves no model-based drafter")
            if verified is not None:
                if sha256 and verified.get("sha256") != sha256:
                    raise ReloadError(f"{ckpt}: verified sha256 {str(verified.get('sha256'))[:16]}…, "
                                      f"the caller says {sha256[:16]}…")
                tensors = read_verified_tensors(ckpt, verified, state["config"])
            else:
                tensors = read_checked_tensors(ckpt, sha256, state["config"])
        except (ReloadError, OSError) as exc:
            state["reloads"]["refused"] += 1
            logger.error("drafter reload refused, still serving %s: %s", previous, exc)
            return {"ok": False, "result": "refused", "error": str(exc), "version": previous,
                    "seconds": time.perf_counter() - start}
        checked = time.perf_counter()
        model = self.model_runner.drafter.model
        from vllm_patches import dflash_context

        dflash_context.flush_runner(self.model_runner)  # deferred context K/V: the old weights' (capture's labels)
        try:
            load_into_serving_model(model, tensors)
        except Exception as exc:  # half-loaded: put the previous weights back
            state["reloads"]["failed"] += 1
            logger.exception("drafter reload of %s failed; restoring %s", ckpt, previous)
            restored = self._restore(model, state)
            return {"ok": False, "result": "failed", "error": f"{type(exc).__name__}: {exc}",
                    "version": previous if restored else None, "restored": restored,
                    "seconds": time.perf_counter() - start}
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        loaded = time.perf_counter()
        version = checkpoint_version(ckpt)
        state.update(path=ckpt, version=version, pinned_current=pinned_current)
        state["reloads"]["ok"] += 1
        from vllm_patches import capture_hooks

        in_flight = None  # captured requests not finished: after a cache reset, recomputed by the new weights
        if (cap := capture_hooks.current()) is not None:
            in_flight = cap.set_version(version, is_cache_reset)
        from vllm_patches import draft_trim

        if (trim := draft_trim.current()) is not None:
            trim.reset()  # the new weights' confidences are calibrated afresh
        logger.info("drafter %s -> %s loaded in %.1f ms (checks %.1f ms)%s", previous, version,
                    1e3 * (loaded - checked), 1e3 * (checked - start),
                    "" if in_flight is None else f"; {in_flight} captured request(s) in flight")
        return {"ok": True, "result": "ok", "version": version, "previous": previous,
                "seconds": loaded - start, "load_seconds": loaded - checked, "in_flight": in_flight}

    def _restore(self, model: torch.nn.Module, state: dict) -> bool:
        path = state["path"]
        if path is None:
            return False
        try:
            load_into_serving_model(model, load_file(path / WEIGHTS_FILE))
            return True
        except Exception:
            logger.exception("could not restore the previous drafter from %s", path)
            return False

    def online_opd_trim(self, thresholds: list[float] | None = None) -> dict | None:
        """Draft trimming (draft_trim.py): set the thresholds by batch size (index 0 unused) when given,
        and return its figures; None when trimming is not installed in this worker."""
        from vllm_patches import draft_trim

        trim = draft_trim.current()
        if trim is None:
            return None
        if thresholds is not None:
            trim.set_thresholds(thresholds)
        return trim.stats()

    def online_opd_flush_capture(self, timeout: float = 10.0) -> dict | None:
        """Write this worker's captured records now (the API server calls it before stopping the
        engine, whose shutdown kills the worker processes); None where nothing is captured."""
        from vllm_patches import capture_hooks

        cap = capture_hooks.current()
        return None if cap is None else {"written": cap.flush(timeout), **cap.stats()}

    def online_opd_status(self) -> dict:
        """Drafter version serving, reload counts and capture figures of this worker."""
        state = self._online_opd_state()
        from vllm_patches import capture_hooks, dflash_context, draft_trim, ngram_fallback

        cap, fallback, trim = capture_hooks.current(), ngram_fallback.current(), draft_trim.current()
        return {"version": state["version"], "path": str(state["path"]) if state["path"] else None,
                "pinned_current": state["pinned_current"], "reloads": dict(state["reloads"]),
                "capture": cap.stats() if cap is not None else None,
                "ngram_fallback": fallback.stats() if fallback is not None else None,
                "draft_trim": trim.stats(with_outlook=False) if trim is not None else None,
                "deferred_context": dflash_context.stats(getattr(self.model_runner, "drafter", None))}
