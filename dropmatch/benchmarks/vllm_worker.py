"""The vLLM side of ``dropmatch.benchmarks.vllm_peer``: runs in vLLM's own environment (``.venv-vllm``).

    VLLM_PLUGINS= .venv-vllm/bin/python -m dropmatch.benchmarks.vllm_worker MODEL_DIR DRAFT_LEN [PREFIX_CACHING]

Imports nothing of this package (vLLM's environment pins another transformers). Builds two engines at
batch size 1, float32, eager mode: ``plain`` (autoregressive) and ``ngram`` (vLLM's prompt-lookup
speculative decoding, ``DRAFT_LEN`` tokens, n-gram sizes 1 to 3, as our ``NgramDrafter``), with vLLM's
automatic prefix caching off unless ``PREFIX_CACHING`` is 1 (our engine starts every generation from an
empty cache; with the cache on, a repeated or few-shot prompt skips most of its prefill). Then reads
one JSON request per line on stdin, ``{"engine": "plain"|"ngram", "prompt_ids": [...], "max_tokens": n}``,
runs it greedily and answers on stdout with a line ``@@peer {"tokens": [...], "seconds": s, "verify_steps": n}``
(the wall time of the ``generate`` call, prefill included; the n-gram engine's speculative steps, else null). vLLM's own log lines go to stderr or carry no marker.
"""

from __future__ import annotations

import json
import sys
import time

MARK = "@@peer "


def build(model_dir: str, draft_len: int, prefix_caching: bool = False) -> dict:
    from vllm import LLM

    common = dict(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=2048, max_num_seqs=1, seed=0,
                  enable_prefix_caching=prefix_caching)
    ngram = {"method": "ngram", "num_speculative_tokens": draft_len, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    return {"plain": LLM(**common),
            "ngram": LLM(**common, speculative_config=ngram, per_request_spec_decode_metrics="summary")}


def serve(engines: dict) -> None:
    from vllm import SamplingParams

    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=int(request["max_tokens"]), ignore_eos=False)
        start = time.perf_counter()
        out = engines[request["engine"]].generate([{"prompt_token_ids": request["prompt_ids"]}], params,
                                                  use_tqdm=False)
        seconds = time.perf_counter() - start
        metrics = getattr(out[0].outputs[0], "spec_decode_metrics", None)
        steps = metrics.to_dict()["num_spec_steps"] if metrics is not None else None
        print(MARK + json.dumps({"tokens": list(out[0].outputs[0].token_ids), "seconds": seconds, "verify_steps": steps}),
              flush=True)


if __name__ == "__main__":
    serve(build(sys.argv[1], int(sys.argv[2]), len(sys.argv) > 3 and sys.argv[3] == "1"))
