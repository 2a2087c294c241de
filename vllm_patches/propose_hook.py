"""One wrapper of the V1 model runner's ``propose_draft_token_ids`` for the hooks that rewrite a step's
drafts after the drafter proposed them: the ngram fallback (ngram_fallback.py) and draft trimming
(draft_trim.py). Each installs it once; the later one wraps the earlier (trimming sees the fallback's
rows). Synchronous scheduling only: under async scheduling the next step is scheduled before the
drafts could be changed, so the hook stays off and says so once. A hook's error is its own to count
and log (``hook.error``); the drafts it was given are kept."""

from __future__ import annotations

import logging
from typing import Any


def wrap_propose(hook: Any, logger: logging.Logger, what: str) -> None:
    """Run ``hook.on_proposed(runner, scheduler_output, sampled_token_ids, drafts)`` on every step's
    drafts (its return value replaces them); ``what`` names the hook in the async-scheduling warning."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig = GPUModelRunner.propose_draft_token_ids
    warned: list[bool] = []

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, *args, **kwargs):
        drafts = orig(self, scheduler_output, sampled_token_ids, *args, **kwargs)
        if getattr(self, "use_async_scheduling", False):
            if not warned:
                warned.append(True)
                logger.warning("online-opd %s is off: this engine schedules asynchronously (the next step "
                               "is scheduled before drafts could be changed)", what)
            return drafts
        try:
            return hook.on_proposed(self, scheduler_output, sampled_token_ids, drafts)
        except Exception as exc:
            hook.error("propose_draft_token_ids", exc)
            return drafts

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
