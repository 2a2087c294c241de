"""The base every config section derives from, and the types several sections share.

Only what online_opd/config.py and its section modules (config_serving.py, config_training.py) have in
common lives here; the sections themselves and the loader do not.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["StrictModel", "PromptSource"]

PromptSource = Literal["sharegpt", "humaneval"]


class StrictModel(BaseModel):
    """Base of every config model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")
