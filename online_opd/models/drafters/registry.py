"""Drafter architectures by name (`method`), and by vLLM architecture name; what a checkpoint's
config.json says about its method and block size (K) is read here and nowhere else."""

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


def method_for_config(hf_config: dict) -> str:
    """The drafter method (``dflash``, ``eagle3``) of a checkpoint's config.json, from its
    ``architectures``: the one place that maps a checkpoint to its method."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(f"unsupported drafter architectures {archs} in config.json; supported: "
                     f"{sorted(ARCHITECTURES)} (save the drafter with save_drafter, or register its class)")


def drafter_class_for_config(hf_config: dict) -> type[nn.Module]:
    """The drafter class for a checkpoint's config.json."""
    return DRAFTERS[method_for_config(hf_config)]


def block_size_for_config(hf_config: dict) -> int:
    """K, the tokens the checkpoint drafts per block, read where its method stores it."""
    return drafter_class_for_config(hf_config).config_cls.block_size_from_hf_config(hf_config)
