"""Two verifiers environments written as a verifiers user writes them (`import verifiers.v1 as vf`), for
jaxflow's verifiers adapter (`jaxflow.envs.verifiers_agent`) and its tests: nothing here knows jaxflow runs them.

- `jaxflow.envs.verifiers_examples.arithmetic`: single-turn. A taskset of the arithmetic task's questions
  whose task scores the one reply with the arithmetic task's reward, and a chat harness that asks once.
- `jaxflow.envs.verifiers_examples.calculator`: multi-turn. The same tasks with a harness that gives the
  model a calculator: a turn ending in `<tool>7 + 5 * 3</tool>` is answered `<result>22</result>` and the
  model goes on, until a turn without a call (the answer, scored as above).

Each module is a verifiers taskset plugin: the one `vf.Taskset` subclass and the one `vf.Harness` subclass
its `__all__` exports (the taskset's bundled harness, the one its agent runs unless the run pins another).
Verifiers loads a plugin by its id, a top-level module's name; the adapter names these by their dotted
path and registers each under a top-level alias (`jaxflow_envs_verifiers_examples_calculator`).

The harnesses run their loop in the rollout's own process (verifiers' documented alternative to launching a
program: every model call still goes through the rollout's interception endpoint), so they need no network
and no sandbox: verifiers' bundled harnesses install their programs with `uv` at each new runtime, and its
MCP tool servers are packages built and installed the same way.
"""
