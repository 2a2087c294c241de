"""Drafter architectures by name (`method`), and by vLLM architecture name."""

from __future__ import annotations

from torch import nn

from online_opd.models.drafters.dflash import DFlashDrafter
from online_opd.models.drafters.eagle3 import Eagle3Drafter

DRAFTERS: dict[str, type[nn.Module]] = {"dflash": DFlashDrafter, "eagle3": Eagle3Drafter}
ARCHITECTURES: dict[str, str] = {"DFlashDraftModel": "dflash", "LlamaForCausalLMEagle3": "eagle3"}


def register(method: str, architecture: str, cls: type[nn.Module]) -> None:
    DRAFTERS[method] = cls
    ARCHITECTURES[architecture] = method


def drafter_class(method: str) -> type[nn.Module]:
    if method not in DRAFTERS:
        raise ValueError(f"unknown drafter method {method!r}; valid: {sorted(DRAFTERS)}")
    return DRAFTERS[method]


def drafter_class_for_config(hf_config: dict) -> type[nn.Module]:
    """The drafter class for a checkpoint's config.json."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return DRAFTERS[ARCHITECTURES[arch]]
    raise ValueError(f"unsupported drafter architectures {archs}; supported: {sorted(ARCHITECTURES)}")
