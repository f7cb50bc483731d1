"""A multi-turn verifiers environment: the arithmetic questions with a calculator tool.

The tasks and their reward are `arithmetic`'s. `CalculatorHarness` is the agent's program, a tool loop:
each model turn stops at `</tool>`; a turn that calls the calculator (`<tool>7 + 5 * 3</tool>`) is
answered with a tool message `<result>22</result>` and the model goes on; a turn without a call, or the
one after `max_calls` calls, ends the rollout and is the reply the task scores. The episode of jaxflow's
calculator agent (`jaxflow.envs.calculator_agent`) written as a verifiers harness, asked with the arithmetic
task's system prompt (the task data's).
"""

from __future__ import annotations

import verifiers.v1 as vf

from jaxflow.envs.calculator import TOOL_CLOSE, tool_calls, tool_result, written_turn
from jaxflow.envs.verifiers_examples.arithmetic import ArithmeticConfig, ArithmeticTask, chat, initial_messages

__all__ = ["CalculatorHarness", "CalculatorTaskset"]


class CalculatorTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self) -> list[ArithmeticTask]:
        from jaxflow.envs.verifiers_examples.arithmetic import ArithmeticTaskset

        return ArithmeticTaskset(self.config).load()


class CalculatorHarnessConfig(vf.HarnessConfig):
    max_calls: int = 2
    """Calculator calls answered; the turn after them is the reply as it stands."""


class CalculatorHarness(vf.Harness[CalculatorHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str,
                     secret: str, mcp_urls: dict[str, str], data: vf.TaskData) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = initial_messages(system, prompt)
        calls = 0
        while True:
            reply = await chat(endpoint, secret, ctx.model, messages, stop=[TOOL_CLOSE])
            choice = reply.choices[0]
            turn = written_turn(choice.message.content or "", choice.finish_reason)
            found = tool_calls(turn)
            if not found or calls >= self.config.max_calls:
                return vf.ProgramResult(exit_code=0, stdout=turn, stderr="")
            calls += 1
            messages += [{"role": "assistant", "content": turn},
                         {"role": "tool", "content": tool_result(found[-1])}]
