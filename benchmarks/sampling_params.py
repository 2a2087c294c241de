"""Which OpenAI / vLLM request parameters `online-opd serve` takes, and whether greedy outputs stay exact with them.

A drafter that memorised six target rollouts (the serving tests' bootstrap, configs/test-serve.yaml) is
served with speculation on every step (`--speculation always`, float32), so drafts are verified on every
request. Two parts:

- **accepted**: one request per parameter set (n, logprobs, prompt logprobs, echo, stop strings and ids,
  penalties, top-p/top-k/min-p, logit bias, min tokens, bad words, allowed ids, JSON mode, a guided
  choice, a seed at T > 0, beam search, streaming with usage, a batch of prompts...), six at a time:
  the HTTP status and, for a refusal, vLLM's message. After them the server must still be healthy and
  give the exact greedy rollout.
- **lossless**: greedy requests on the six rollout prompts with each output-shaping parameter (penalties,
  bad words, allowed ids, min tokens, stops, top-k 1), four at a time, against vLLM's own
  non-speculative float32 engine with the same SamplingParams: the token ids must be equal.

    python benchmarks/sampling_params.py --run-dir runs/test-serve-bootstrap --out benchmarks/results/sampling_params.json
    python benchmarks/sampling_params.py --serve-arg=-o --serve-arg=serve.draft_trim.enabled=true ...

`--run-dir` is trained first if it holds no drafter (about 5 min). One JSON object on stdout.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from serve.launcher import ROOT, ServerProcess, emit_result, tau

logger = logging.getLogger("sampling_params")
CONFIG = ROOT / "configs" / "test-serve.yaml"
MAX_TOKENS = 48
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]


def accepted_cases(prompt: list[int], other: list[int]) -> dict[str, tuple[str, dict]]:
    """(route, body) per parameter set; `prompt` and `other` are token-id prompts."""
    completion = lambda **kw: ("/v1/completions", {"prompt": prompt, "max_tokens": 16, **kw})  # noqa: E731
    chat = lambda **kw: ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 16, **kw})  # noqa: E731
    return {
        "n=2 T=0.8": completion(n=2, temperature=0.8),
        "n=3 T=0.8 stream": completion(n=3, temperature=0.8, stream=True),
        "n=2 greedy": completion(n=2, temperature=0.0),
        "logprobs=5": completion(logprobs=5),
        "logprobs=5 T=0.8": completion(logprobs=5, temperature=0.8),
        "chat logprobs top_logprobs=3": chat(logprobs=True, top_logprobs=3),
        "prompt_logprobs=2": completion(prompt_logprobs=2),
        "echo": completion(echo=True),
        "stop strings": completion(stop=["\n", "."]),
        "stop_token_ids": completion(stop_token_ids=[13, 198]),
        "presence and frequency penalties": completion(presence_penalty=1.0, frequency_penalty=1.0),
        "repetition_penalty T=0.7": completion(repetition_penalty=1.3, temperature=0.7),
        "top_p=0.9 top_k=5 T=0.8": completion(temperature=0.8, top_p=0.9, top_k=5),
        "min_p=0.1 T=0.8": completion(temperature=0.8, min_p=0.1),
        "logit_bias": completion(logit_bias={"28": 5}),
        "min_tokens": completion(max_tokens=24, min_tokens=20),
        "bad_words": completion(bad_words=["the", " a"]),
        "allowed_token_ids": completion(allowed_token_ids=[28, 29, 30, 198]),
        "response_format json_object": chat(response_format={"type": "json_object"}),
        "structured_outputs choice": chat(structured_outputs={"choice": ["yes", "no"]}),
        "seed T=0.8": completion(temperature=0.8, seed=3),
        "T=2.0": completion(temperature=2.0),
        "max_tokens=1": completion(max_tokens=1),
        "stream include_usage": completion(stream=True, stream_options={"include_usage": True}),
        "skip_special_tokens=false": completion(skip_special_tokens=False),
        "truncate_prompt_tokens=16": completion(truncate_prompt_tokens=16),
        "use_beam_search n=2": completion(use_beam_search=True, n=2),
        "two prompts": ("/v1/completions", {"prompt": [prompt, other], "max_tokens": 16}),
        "ignore_eos": completion(max_tokens=40, ignore_eos=True),
    }


#: Output-shaping SamplingParams checked greedy against the non-speculative engine.
LOSSLESS = {
    "none": {},
    "repetition_penalty": {"repetition_penalty": 1.3},
    "presence_penalty": {"presence_penalty": 1.5},
    "frequency_penalty": {"frequency_penalty": 1.0},
    "bad_words": {"bad_words": ["the", " a", "."]},
    "allowed_token_ids": {"allowed_token_ids": list(range(200, 2000))},
    "min_tokens": {"min_tokens": 40},
    "stop": {"stop": [". "]},
    "stop_token_ids": {"stop_token_ids": [30]},
    "top_k=1": {"top_k": 1},
}


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{route}", json=body, timeout=600)


def error_message(response: httpx.Response) -> str | None:
    if response.status_code == 200:
        return None
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:300]


def served(server: ServerProcess, rollouts: list) -> dict:
    """Both parts' served side: statuses per parameter set, greedy token ids per LOSSLESS setting."""
    model = httpx.get(f"{server.url}/v1/models", timeout=30).json()["data"][0]["id"]
    cases = accepted_cases(rollouts[1][0], rollouts[2][0])

    def one_case(item):
        name, (route, body) = item
        start = time.perf_counter()
        response = post(server.url, route, {"model": model, **body})
        return name, {"status": response.status_code, "error": error_message(response),
                      "seconds": round(time.perf_counter() - start, 2)}

    with ThreadPoolExecutor(6) as pool:
        accepted = dict(pool.map(one_case, cases.items()))
    prompt, expected = rollouts[0]
    health = httpx.get(f"{server.url}/health", timeout=30).status_code
    after = post(server.url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": len(expected),
                                                 "temperature": 0.0, "return_token_ids": True})
    still_exact = after.status_code == 200 and after.json()["choices"][0]["token_ids"] == expected

    def one_greedy(item):
        name, index = item
        response = post(server.url, "/v1/completions", {
            "model": model, "prompt": rollouts[index][0], "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "return_token_ids": True, **LOSSLESS[name]})
        response.raise_for_status()
        return name, index, list(response.json()["choices"][0]["token_ids"])

    before = server.metrics()
    greedy: dict[str, dict[int, list[int]]] = {}
    with ThreadPoolExecutor(4) as pool:
        for name, index, ids in pool.map(one_greedy, [(n, i) for n in LOSSLESS for i in range(len(rollouts))]):
            greedy.setdefault(name, {})[index] = ids
    served_tau, drafts = tau(before, server.metrics())
    return {"accepted": accepted, "healthy_after": health == 200, "exact_after": still_exact,
            "greedy": greedy, "greedy_tau": round(served_tau, 4), "greedy_drafts": drafts}


def reference(rollouts: list) -> dict[str, list[list[int]]]:
    """vLLM's non-speculative float32 engine, same SamplingParams, greedy."""
    from vllm import LLM, SamplingParams, TokensPrompt

    from online_opd.models.target import ensure_embedded_target
    from serve.engine import shutdown

    llm = LLM(model=str(ensure_embedded_target()), dtype="float32", max_model_len=1024, enforce_eager=True,
              max_num_seqs=8, distributed_executor_backend="uni")
    try:
        out = {}
        for name, params in LOSSLESS.items():
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in rollouts],
                                   SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **params), use_tqdm=False)
            out[name] = [list(o.outputs[0].token_ids) for o in outputs]
        return out
    finally:
        shutdown(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, default=ROOT / "runs" / "test-serve-bootstrap",
                        help="the memorising drafter's bootstrap run (trained here when it holds none)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `online-opd serve` argument (repeat; e.g. --serve-arg=-o "
                             "--serve-arg=serve.draft_trim.enabled=true)")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dtype_parity import bootstrap  # sibling script: benchmarks/ leads sys.path

    from online_opd.train.sequences import load_sequences

    bootstrap(args.run_dir)
    seqs = load_sequences(args.run_dir / "rollouts.safetensors")
    rollouts = [(s.tokens[: s.prompt_len].tolist(), s.tokens[s.prompt_len:].tolist()) for s in seqs]
    with tempfile.TemporaryDirectory(prefix="sampling-params-") as work:
        server = ServerProcess(Path(work) / "serve", CONFIG, "--drafter", str(args.run_dir / "drafter"),
                               "--speculation", "always", *args.serve_arg)
        try:
            server.wait_ready(timeout=900)
            result = served(server, rollouts)
        finally:
            server.stop()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    ref = reference(rollouts)
    result["lossless"] = {name: sum(result["greedy"][name][i] == ids for i, ids in enumerate(ref[name]))
                          for name in LOSSLESS}
    result["lossless_of"] = len(rollouts)
    del result["greedy"]
    result["refused"] = {name: case["error"] for name, case in result["accepted"].items() if case["status"] != 200}
    result["serve_args"] = args.serve_arg
    emit_result(result, args.out)


if __name__ == "__main__":
    main()
