"""The arithmetic task with a calculator tool: multi-turn episodes on a tiny model.

The model may call the calculator (`<tool>7 + 5 * 3</tool>`); the environment (`jaxflow.envs.calculator`)
answers `<result>22</result>`, rendered through the chat template as a tool turn; the model's next turn
gives `<answer>22</answer>`, which the task's reward scores. The warm start demonstrates the tool on
`task.tool_fraction` of its problems and works the others out step by step, so the base model sometimes
calls it; RL can teach it when and how (the arithmetic facts the tiny model lacks are the tool's). Evals
run the same episodes, greedily.

Everything else is configs/arithmetic_tiny.py's (its variants too: `:sync` for eta = 0). The variant
`:moe` (combines with the option `small`: `:moe,small`) swaps the dense model for a tiny mixture of experts
(Qwen3-MoE: 4 experts, top-2, each half the dense MLP's width, so a token computes what it would in the
dense model) built by its own warm start, and trains it with routing replay (`trainer.moe`). Its warm start
adds the routers' load-balancing loss (`model.router_aux_loss_coef`), as MoE models are pretrained with one;
its first layer keeps the dense MLP and its second is sparse, as DeepSeek-V3, GLM-4.5 and Kimi K2 keep
their first layers dense. benchmarks/moe_learning.py measures it against the dense model, and against the
same mixture with both layers sparse.

Commands:
  .venv/bin/python -m jaxflow.main --config=configs/arithmetic_tools_tiny.py
  .venv/bin/python -m jaxflow.main --config=configs/arithmetic_tools_tiny.py --config.rollout.env.options.latency_s=0.2
  .venv/bin/python -m jaxflow.main --config=configs/arithmetic_tools_tiny.py:moe
"""

import pathlib

import ml_collections

from jaxflow.config import base_config
from jaxflow.envs.config import env_section


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    variant, *options = (arg or "async").split(",")
    moe = variant == "moe"
    config = base_config(pathlib.Path(__file__).with_name("arithmetic_tiny.py"),
                         ",".join(["async" if moe else variant, *options]))
    config.workdir = f"runs/arithmetic_tools_tiny_{variant}"
    config.base.dir = "runs/base/arithmetic_tools_tiny" + ("_moe" if moe else "")
    if moe:
        config.model.architecture = "Qwen3MoeForCausalLM"
        config.model.num_experts = 4
        config.model.num_experts_per_tok = 2
        config.model.moe_intermediate_size = config.model.intermediate_size // 2
        config.model.mlp_only_layers = (0,)
        config.model.router_aux_loss_coef = 0.01
        config.trainer.moe.routing_replay = "rollout"
    # The fraction of warm-start demonstrations that call the calculator instead of working it out.
    config.task.tool_fraction = 0.25
    # The tool-call markers, one token each in the tiny tokenizer (the turn stops at "</tool>").
    config.model.extra_tokens = ("<tool>", "</tool>", "<result>", "</result>")
    # One episode: a tool call, the tool's answer, the answer; or an answer straight away.
    config.rollout.env = env_section(ref="jaxflow.envs.calculator:CalculatorEnv", turn_stop="</tool>",
                                     options={"latency_s": 0.0, "max_calls": 2}, step_timeout_s=10.0,
                                     max_turns=3)
    # 16 groups a step (the single-turn task's 32 halved). What environment-level asynchrony gains is the
    # tool's waits against the compute a step holds: a synchronous step computes, then waits on its
    # slowest episode's tool calls, while an asynchronous one fills those waits with later steps' work.
    # At 32 groups a step's compute outweighed a 0.3 s tool (benchmarks/async_vs_sync.py measures both).
    config.trainer.batch_groups = 16
    # An episode waiting on its tool holds one of the engine's `max_running` places but computes nothing:
    # twice the single-turn task's places keep the engine's rows busy meanwhile (slots stay as they are;
    # a synchronous step's 128 episodes fit either way).
    config.rollout.coordination.max_running *= 2
    # Room for the tool turn, its rendered answer and the answer turn.
    config.rollout.max_tokens = 160
    config.rollout.max_len = 224
    return config
