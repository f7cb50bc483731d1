"""Run by tests/rollout_bridge/test_vllm_lora.py in a process of its own: vLLM (its public offline API,
`LLM(enable_lora=True)` + `LoRARequest`) serves a base model and one PEFT adapter directory per version,
greedy, and prints each request's tokens and log-probs as one JSON line. Then it kills vLLM's engine core
and worker processes and ends with os._exit, so that no engine shutdown can hang the test.

    python vllm_lora_server.py BASE_DIR RANK PROMPTS_JSON ADAPTER_DIR [ADAPTER_DIR ...]
"""

import json
import os
import sys


def main() -> None:
    base, rank, prompts, adapters = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4:]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (vLLM's default takes far more)
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(base, enable_lora=True, max_lora_rank=rank, max_loras=1, enforce_eager=True, max_model_len=128,
              max_num_seqs=4, dtype="float32", seed=0)
    sampling = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    out = []
    for version, adapter in enumerate(adapters, start=1):  # a new adapter per version, requests on the newest
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], sampling,
                               lora_request=LoRARequest(f"v{version}", version, adapter), use_tqdm=False)
        out.append([{"tokens": list(r.outputs[0].token_ids),
                     "logprobs": [next(iter(lp.values())).logprob for lp in r.outputs[0].logprobs]}
                    for r in results])
    print("VLLM_LORA " + json.dumps(out), flush=True)
    import psutil  # a vLLM dependency
    for child in psutil.Process().children(recursive=True):
        child.kill()
    os._exit(0)


if __name__ == "__main__":
    main()
