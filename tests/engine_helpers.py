"""Helpers shared by the engine tests (JAX engine, vLLM): prompts, runs, a model with lively weights, and
jaxflow's own teacher-forced forward, the reference every engine's tokens and log-probs are checked on."""

import contextlib
import os
import time

import jax
import numpy as np
from flax import nnx

from jaxflow.models.hf_io import export_model, iter_hf_tensors, load_model, params_from_hf
from jaxflow.models.tiny import write_tiny_model
from rollout_bridge.engine import Request, SamplingParams

PROMPT_LENS = (1, 3, 11, 30, 50, 7)


def require_vllm(what: str) -> None:
    """Skips the calling test module when vLLM is not importable (call it at module level), except under
    CI, where vLLM must run: there the ImportError fails the module."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI"):
            raise
        import pytest
        pytest.skip(f"vLLM is not importable ({e}); install the rollout-cpu or rollout-gpu extra to run {what}",
                    allow_module_level=True)
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@contextlib.contextmanager
def counting_lowerings():
    """A list that gets the name of each program JAX lowers (turns into an MLIR module, where every
    compile starts: "jit_decode", ...) while the block runs, in any thread."""
    seen = []

    def listener(event, duration_s, fun_name="?", **_):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            seen.append(fun_name)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def prompts(seed=0, lens=PROMPT_LENS, vocab=500):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lens]


def run(engine, token_lists, params=GREEDY, tag="r"):
    reqs = [Request(f"{tag}{i}", p, params) for i, p in enumerate(token_lists)]
    return engine.generate(reqs, timeout=120)


def poll_all(engine, n, timeout=120.0):
    """Polls until `n` completions came out; {request id: completion}."""
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out += engine.poll(timeout=1.0)
    assert len(out) == n, [c.request_id for c in out]
    return {c.request_id: c for c in out}


@nnx.jit
def _logits(model, tokens):
    return model(tokens)


def forward_logits(model, prompt, completion, pad_to=None):
    """Teacher-forced logits [len(completion), V] that predict each completion token under `model`.
    pad_to: run every sequence at that length (one shape, one compile; causal, so the tail is inert)."""
    n = len(prompt) + len(completion)
    seq = np.zeros((1, pad_to or n), np.int32)
    seq[0, :n] = prompt + completion
    return np.asarray(_logits(model, seq))[0, len(prompt) - 1:n - 1]


def teacher_forced(model, prompt, completion, pad_to=None):
    """(log-probs of `completion` given prompt, argmax tokens at the same positions) under `model`."""
    logits = forward_logits(model, prompt, completion, pad_to)
    logp = np.asarray(jax.nn.log_softmax(logits, -1))
    return logp[np.arange(len(completion)), completion], logits.argmax(-1)


def perturbed(model, seed, scale=0.05):
    """(model with every weight moved by scale * N(0, 1), its HF tensors): the weights a trainer pushes."""
    rng = np.random.default_rng(seed)
    tensors = {name: (t + scale * rng.standard_normal(t.shape)).astype(t.dtype)
               for name, t in iter_hf_tensors(model)}
    return nnx.merge(nnx.graphdef(model), params_from_hf(model.config, tensors)), tensors


def lively_tiny_model(directory, architecture="Qwen3ForCausalLM", **kw):
    """`write_tiny_model` with weights ~10x its initializer's (norm scales around 1): a model whose greedy
    output is not one token repeated, so that comparisons of token sequences mean something."""
    directory = write_tiny_model(directory, architecture=architecture, **kw)
    model = load_model(directory)
    rng = np.random.default_rng(1)
    tensors = {name: (1 + 0.2 * rng.standard_normal(t.shape) if name.endswith("norm.weight")
                      else 0.2 * rng.standard_normal(t.shape)).astype(t.dtype)
               for name, t in iter_hf_tensors(model)}
    model = nnx.merge(nnx.graphdef(model), params_from_hf(model.config, tensors))
    return export_model(model, directory, overwrite=True)


def lively_tiny_moe_model(directory, *, head_dim=16, seed=0):
    """A tiny Qwen3-MoE (hidden 32, 3 layers of which layer 1 is dense through mlp_only_layers, 4 experts,
    top-2) with the tiny tokenizer, written to `directory` (returned), with weights lively as
    `lively_tiny_model`'s, so that both its greedy tokens and its routes vary. head_dim 32 for vLLM."""
    from jaxflow.models.config import ModelConfig
    from jaxflow.models.tiny import write_tiny_tokenizer
    from jaxflow.models.transformer import Transformer

    tokenizer = write_tiny_tokenizer(directory, seed=seed)
    cfg = ModelConfig(architecture="Qwen3MoeForCausalLM", vocab_size=-(-tokenizer.vocab_size // 64) * 64,
                      hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2, num_kv_heads=1,
                      head_dim=head_dim, qk_norm=True, tie_word_embeddings=True, max_position_embeddings=2048,
                      eos_token_id=tokenizer.eos_id, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=(1,))
    model = Transformer(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed + 1)
    tensors = {name: (1 + 0.2 * rng.standard_normal(t.shape) if name.endswith("norm.weight")
                      else 0.3 * rng.standard_normal(t.shape)).astype(t.dtype)
               for name, t in iter_hf_tensors(model)}
    model = nnx.merge(nnx.graphdef(model), params_from_hf(cfg, tensors))
    return export_model(model, directory, overwrite=True)


def check_bad_weights_are_rejected(engine, good, greedy_reference):
    """Weights with a missing, extra, wrong-shape or wrong-dtype tensor are refused, naming it; the engine
    keeps its version and serves exactly what it served before."""
    import pytest

    from rollout_bridge.engine import WeightsRejected

    name = "model.layers.1.mlp.up_proj.weight"
    cases = {
        "missing": ({k: v for k, v in good.items() if k != name}, name),
        "extra": ({**good, "model.layers.9.mlp.up_proj.weight": good[name]}, "layers.9"),
        "shape": ({**good, name: good[name][:, :10]}, name + ".*shape"),
        "dtype": ({**good, name: good[name].astype(np.float16)}, name + ".*float16"),
    }
    version = engine.version
    for what, (tensors, pattern) in cases.items():
        with pytest.raises(WeightsRejected, match=pattern):
            engine.update_weights(version + 1, tensors)
        assert engine.version == version, what
    assert [c.sample.tokens for c in run(engine, prompts(), tag="after")] == greedy_reference


def check_stop_tokens_and_max_tokens(engine, greedy_reference):
    """Stop tokens end a sample (kept as its last token); max_tokens counts a resumed prefix, which keeps
    its own versions, and a prefix that already reaches it generates nothing."""
    from jaxflow.data.records import Sample

    p, ref = prompts()[2], greedy_reference[2]
    stops = (ref[5], ref[9])
    first = min(ref.index(t) for t in stops)
    c = engine.generate([Request("s", p, SamplingParams(max_tokens=24, temperature=0.0,
                                                        stop_token_ids=stops))])[0]
    assert c.sample.tokens == ref[:first + 1] and c.sample.finish_reason == "stop"
    c = engine.generate([Request("m", p, SamplingParams(max_tokens=5, temperature=0.0))])[0]
    assert c.sample.tokens == ref[:5] and c.sample.finish_reason == "length"
    prefix = Sample(ref[:3], [0.0] * 3, [0] * 3, "abort")
    c = engine.generate([Request("p", p, SamplingParams(max_tokens=5, temperature=0.0), prefix)])[0]
    assert c.sample.tokens == ref[:5] and c.sample.finish_reason == "length"
    assert c.sample.versions == [0] * 3 + [engine.version] * 2
    c = engine.generate([Request("q", p, SamplingParams(max_tokens=3, temperature=0.0), prefix)])[0]
    assert c.sample.tokens == ref[:3] and c.sample.finish_reason == "length"


def adapted(base_dir, spec, seed):
    """The base model with LoRA adapters `spec` whose B is random (seeded), so that they change its outputs
    (a fresh adapter's B is zero)."""
    model = load_model(base_dir, lora=spec)
    key = jax.random.key(seed)
    for t in spec.targets:
        var = getattr(model.layers, f"{t}_lora_b")
        key, sub = jax.random.split(key)
        var[...] = 0.2 * jax.random.normal(sub, var[...].shape)
    return model


def check_judge(engine, tokenizer):
    """An LLM judge (`rollout_bridge.judge.Judge`) on `engine` (a model with `tokenizer`, idle, not closed here):
    verdicts past a deadline too short to generate them are aborted, leaving the engine with nothing running,
    and counted; a judge with time enough then scores two groups' samples together, each with the parse of
    what the engine generates greedily for its prompt alone."""
    from waiting import wait_until

    from rollout_bridge.judge import Judge

    def prompt(response, meta):
        return [{"role": "user", "content": f"{meta['question']} {response}"}]

    def parse(verdict, meta):
        return float(len(verdict))

    groups = [(["1 + 2 = 3", "3"], {"question": "What is 1 + 2?"}), (["7 - 2 = 5", "9"], {"question": "Q"})]
    kw = {"prompt_ref": prompt, "parse_ref": parse, "max_tokens": 64, "failed_value": -1.0, "close_engine": False,
          "on_failure": lambda message: None}
    with Judge(engine, tokenizer, timeout_s=1e-3, **kw) as hasty:
        scores = hasty.score_group(hasty.name, *groups[0])
        stats = hasty.stats()
    assert stats["timed_out"] >= 1 and stats["aborted"] == stats["timed_out"]
    assert stats["timed_out"] + stats["scored"] == 2 and scores.count(-1.0) == stats["timed_out"]
    wait_until(lambda: engine.load().running + engine.load().waiting == 0, 30, "the aborted requests gone")
    with Judge(engine, tokenizer, timeout_s=120.0, **kw) as judge:
        scores = [s for group in judge.score_groups(judge.name, groups) for s in group]
        assert judge.stats()["scored"] == 4
    samples = [(response, meta) for responses, meta in groups for response in responses]
    alone = engine.generate([Request(f"alone-{i}", tokenizer.encode(tokenizer.apply_chat_template(prompt(r, meta))),
                                     judge.params) for i, (r, meta) in enumerate(samples)])
    assert scores == [parse(tokenizer.decode(c.sample.tokens), None) for c in alone]
    assert len(set(scores)) > 1  # different prompts, different verdicts: the comparison means something
