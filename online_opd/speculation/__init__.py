"""How much to speculate: step costs, acceptance estimates and the goodput policy.

- ``costs.py``: measured seconds per engine step by (batch size b, speculative
  tokens K) and the cost model t(b, K) fitted to them;
- ``acceptance.py``: per-position acceptance a_k = P(at least k drafts accepted)
  from verified drafts of any length, and a profile from a single tau;
- ``policy.py``: the K per batch size that maximises expected output tokens per
  second, in vLLM's ``num_speculative_tokens_per_batch_size`` format.

Pure Python and numpy: the engine hooks (vllm_patches/speculation.py) measure,
the server's policy loop (vllm_patches/speculation_loop.py) decides with these.
"""
