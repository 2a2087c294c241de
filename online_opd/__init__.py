"""online-opd core: drafters, Draft-OPD loss, packed replay, trainer, records.

Pure torch + transformers + safetensors + pydantic. Never imports vllm or ray.
"""

__version__ = "0.1.0"
