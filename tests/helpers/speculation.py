"""Hand-made scheduler outputs, a fake engine core and engine client around the real speculation
control (vllm_patches/speculation.py), for the policy and trimming tests without an engine."""

from __future__ import annotations

from types import SimpleNamespace

from vllm_patches.speculation import SpeculationControl, set_speculation


def step(sizes: dict[str, int], k: int, drafts: dict[str, int] | None = None, new: bool = False):
    """A SchedulerOutput's fields the control reads: request -> scheduled tokens, K, drafts verified."""
    spec = {rid: [7] * n for rid, n in (drafts or {}).items()}
    return SimpleNamespace(num_scheduled_tokens=sizes, num_spec_tokens_to_schedule=k,
                           scheduled_spec_decode_tokens=spec, scheduled_new_reqs=[object()] if new else [])


def output(sampled: dict[str, int]):
    """A ModelRunnerOutput: request -> number of tokens sampled this step."""
    ids = list(sampled)
    return SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(ids)},
                           sampled_token_ids=[[1] * sampled[r] for r in ids])


def run(control: SpeculationControl, out, model_output, start: float, end: float) -> None:
    control.on_scheduled(out, start)
    control.on_output(out, model_output, end)


def fake_engine_core(lookup: list[int], max_k: int = 4):
    scheduler = SimpleNamespace(dynamic_sd_lookup=lookup, num_spec_tokens=max_k,
                                scheduler_config=SimpleNamespace(max_num_seqs=len(lookup) - 1))
    return SimpleNamespace(scheduler=scheduler)


class FakeEngineClient:
    """The engine client's utility call, answered by a real SpeculationControl in a fake engine core."""

    def __init__(self, core, trim=None):
        self.core = core
        self.trim = trim  # a real draft_trim.DraftTrim standing for the worker's, or None (not installed)
        self.calls: list[tuple] = []
        self.rpc_calls: list[tuple] = []
        self.engine_core = self

    async def collective_rpc(self, method: str, args: tuple = ()):
        """The worker extension's ``online_opd_trim``, one worker."""
        assert method == "online_opd_trim", method
        self.rpc_calls.append((method, *args))
        if self.trim is None:
            return [None]
        if args and args[0] is not None:
            self.trim.set_thresholds(args[0])
        return [self.trim.stats()]

    async def call_utility_async(self, method: str, *args):
        from vllm_patches.speculation import speculation_status

        self.calls.append((method, *args))
        return set_speculation(self.core, *args) if method == "online_opd_set_speculation" \
            else speculation_status(self.core)


def feed(control: SpeculationControl, b: int, k: int, seconds: float, num: int, accepted: int = 0) -> None:
    for i in range(num):
        sizes = {f"r{j}": 1 + k for j in range(b)}
        out = step(sizes, k, {r: k for r in sizes} if k else None)
        start = control._last_end + 1.0  # idle between steps: each step's own time is timed
        run(control, out, output({r: 1 + accepted for r in sizes}), start, start + seconds)
