"""Building engines: `make_engine` (a JAX or a vLLM engine by name, with the same limits for both) and
`with_episodes` (an environment's episodes over it, when the `rollout.env` section names one).

The RL job's engines, its evaluator's, its rollout actors' and the rollout worker CLI's all come from
here, so every engine of a run is built the same way.
"""

from __future__ import annotations

import ml_collections

from jaxflow.config import ConfigError
from jaxflow.envs.config import env_problems, environment_factory, runs_agents, turn_stop_ids
from jaxflow.models import precision

__all__ = ["make_engine", "runs_episodes", "with_episodes"]


def make_engine(kind: str, model, max_len: int, max_slots: int, *, seed: int = 0, decode_chunk: int = 16,
                kv_cache_gib: float | None = 1.0, version: int = 0, lora=None, episodes: bool = True,
                weight_transport: str = "auto", weight_bucket_bytes: int | None = None, dtype: str | None = None,
                exact_logprobs: bool = False, logprob_chunk: int | None = None):
    """The engine named by `kind` ("jax" or "vllm") serving `model` (an HF directory; a JAX engine also
    takes a `Transformer`) at policy `version`, with `max_slots` sequences of up to `max_len` tokens
    (prompt + completion) at once and sampling seeded by `seed`. jax: a `JaxEngine` decoding
    `decode_chunk` tokens a call. vllm: a `VllmEngine` with a KV cache of `kv_cache_gib` GiB (None:
    vLLM's own sizing) and CUDA graphs off (`enforce_eager`, as the RL job's engines: no graph capture at
    start, and on CPU no torch.compile, the sampler's included). lora (a `LoRASpec`): either engine serves
    LoRA adapters over the base, and each version is the adapters alone (PEFT-named tensors). episodes:
    False when no request continues an earlier one (no environment): a JAX engine then keeps no finished
    turns and compiles no extend programs. weight_transport: the resolved `rollout.weight_transport`
    (`rollout_bridge.weight_transport`): "nccl" gives a vLLM engine its NCCL group, with buckets of
    `weight_bucket_bytes`, and is a WeightTransportMismatch for a JAX engine; the others are host or device
    paths every engine takes as it is. dtype: what the engine computes in (`model.compute_dtype`: "float32"
    or "bfloat16"); a JAX engine casts the weights it is given (and each version it syncs) to it, vLLM is
    started with it and casts the versions it is sent. None: the model's own dtype (JAX), float32 (vLLM). A dtype
    neither engine takes is a DtypeError before any engine starts. exact_logprobs, logprob_chunk: the JAX
    engine's exact mode (`rollout.exact_logprobs`) with the trainer's `logprob_chunk`; vLLM has none."""
    if dtype is not None:
        precision.dtype_of(dtype)
    if weight_transport == "nccl" and kind == "jax":
        from rollout_bridge.weight_transport import WeightTransportMismatch

        raise WeightTransportMismatch("weight_transport 'nccl' does not fit the JAX engine (it takes versions on "
                                      "device in the job's process, or as host tensors)")
    if kind == "jax":
        from rollout_bridge.jax_engine import JaxEngine

        if lora is not None and not hasattr(model, "layers"):
            from jaxflow.models import hf_io
            model = hf_io.load_model(model, lora=lora)
        return JaxEngine(model, max_slots=max_slots, max_len=max_len, decode_chunk=decode_chunk, version=version,
                         seed=seed, reuse_turns=episodes, compute_dtype=dtype, exact_logprobs=exact_logprobs,
                         **({} if logprob_chunk is None else {"logprob_chunk": logprob_chunk}))
    if kind == "vllm":
        from rollout_bridge.vllm_engine import VllmEngine

        if exact_logprobs:
            raise ValueError("exact_logprobs needs the JAX engine: vLLM's kernels are not the trainer's")

        # A version arrives in the trainer's parameter dtype; an engine computing in another one casts it.
        return VllmEngine(model, version=version, max_len=max_len, max_slots=max_slots,
                          kv_cache_gib=kv_cache_gib, seed=seed, enforce_eager=True, lora=lora,
                          dtype=dtype or "float32", cast_weights=dtype not in (None, "float32"),
                          **({"weight_transport": "nccl", "weight_bucket_bytes": weight_bucket_bytes}
                             if weight_transport == "nccl" else {}))
    raise ValueError(f"unknown engine {kind!r}; valid: jax, vllm")


def runs_episodes(env) -> bool:
    """Whether the `rollout.env` section `env` (a ConfigDict, its dict, or None) names an environment."""
    return env is not None and (env.get("ref") is not None or runs_agents(env))


def agent_runner(env: ml_collections.ConfigDict):
    """The agent a checked `rollout.env` section of kind "agent" or "command" names:
    `rollout_bridge.agent_engine.FunctionAgent` (`IsolatedAgent` with `isolate`) or `CommandAgent`."""
    from jaxflow import refs
    from rollout_bridge.agent_engine import CommandAgent, FunctionAgent, IsolatedAgent

    if env.kind == "command":
        return CommandAgent(list(env.command))
    options = env.options.to_dict() if isinstance(env.options, ml_collections.ConfigDict) else env.options
    agent = FunctionAgent(refs.resolve(env.ref, what="agent reference", expect="function"), options, ref=env.ref)
    return IsolatedAgent(agent) if env.get("isolate", False) else agent


def with_episodes(env, tokenizer):
    """engine -> the engine itself, or (the `rollout.env` section `env` names an environment: a ConfigDict
    or its dict) an EpisodeEngine running that environment's episodes on it, or (kind "agent"/"command")
    an AgentEngine running the agent's episodes on it through its own endpoint. ConfigError when the
    section is bad (its turn_stop not one token of `tokenizer`, ...)."""
    if not runs_episodes(env):
        return lambda engine: engine
    if isinstance(env, dict):
        env = ml_collections.ConfigDict(env)
    problems = env_problems(env, tokenizer)
    if problems:
        raise ConfigError("bad config: " + "; ".join(problems))
    if runs_agents(env):
        from rollout_bridge.agent_engine import AgentEngine
        agent = agent_runner(env)
        return lambda engine: AgentEngine(engine, agent, tokenizer, max_context=engine.max_len,
                                          timeout_s=env.agent_timeout_s)
    from rollout_bridge.episodes import EpisodeEngine
    make_env, stops = environment_factory(env), turn_stop_ids(env, tokenizer)
    return lambda engine: EpisodeEngine(engine, make_env, tokenizer, turn_stop_ids=stops,
                                        step_timeout_s=env.step_timeout_s, max_turns=env.max_turns,
                                        env_name=env.ref,
                                        max_observation_tokens=env.get("max_observation_tokens"))
