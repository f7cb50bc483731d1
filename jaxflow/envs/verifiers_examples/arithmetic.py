"""A single-turn verifiers environment: arithmetic questions, one reply, scored by the arithmetic task's reward.

The taskset's own data is the arithmetic task's train split (`num_tasks` questions; `vf-eval`-style runs
iterate it); a jaxflow run hands each episode its task instead, from the run's task source, as data of
this taskset's task type (`jaxflow.envs.verifiers_agent`). `ChatHarness` is the agent's program: one chat
completion against the rollout's endpoint, run in process.
"""

from __future__ import annotations

import asyncio
import weakref

import verifiers.v1 as vf

from jaxflow.tasks import SYSTEM_PROMPT, get_task
from jaxflow.tasks.arithmetic import reward as arithmetic_reward

__all__ = ["ArithmeticTaskset", "ChatHarness"]


class ArithmeticData(vf.TaskData):
    """One question (the prompt) and its integer answer, asked with the arithmetic task's system prompt."""

    system_prompt: str | None = SYSTEM_PROMPT
    answer: int
    format_score: float = 0.0
    """The reward of a well-formed wrong answer."""


class ArithmeticTask(vf.Task[ArithmeticData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        """1.0 when the last reply's `<answer>` is the answer, else 0.0 (or the format score)."""
        replies = trace.assistant_messages
        text = (replies[-1].content or "") if replies else ""
        return arithmetic_reward(text, {"answer": self.data.answer, "format_score": self.data.format_score})


class ArithmeticConfig(vf.TasksetConfig):
    num_tasks: int = 64
    """How many train-split questions `load` builds."""
    seed: int = 0
    max_ops: int = 2


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    def load(self) -> list[ArithmeticTask]:
        task = get_task("arithmetic", max_ops=self.config.max_ops)
        return [ArithmeticTask(ArithmeticData(prompt=e["question"], answer=e["answer"]), self.config.task)
                for e in task.examples("train", n=self.config.num_tasks, seed=self.config.seed)]


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """One model turn: the task's prompt in, the reply out (the trace records it at the endpoint)."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str,
                     secret: str, mcp_urls: dict[str, str], data: vf.TaskData) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = initial_messages(system, prompt)
        reply = await chat(endpoint, secret, ctx.model, messages)
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


def initial_messages(system: str | None, prompt) -> list[dict]:
    """The chat a harness opens with: the system prompt, then the prompt (text or messages)."""
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        return messages + [{"role": "user", "content": prompt}]
    return messages + [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
                       for m in prompt or []]


async def chat(endpoint: str, secret: str, model: str, messages: list[dict], **kwargs):
    """One chat completion through the rollout's interception endpoint (its bearer token `secret`)."""
    client = _client().with_options(base_url=endpoint, api_key=secret)
    return await client.chat.completions.create(model=model, messages=messages, **kwargs)


_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its client


def _client():
    """One client per event loop, its connections shared by the rollouts on that loop (each a copy with its
    own endpoint and token): a client costs tens of milliseconds to make (its TLS context)."""
    import openai

    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        client = _clients[loop] = openai.AsyncOpenAI(base_url="http://127.0.0.1", api_key="none", max_retries=0,
                                                      timeout=600.0)
    return client
