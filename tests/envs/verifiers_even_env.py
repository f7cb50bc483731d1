"""A verifiers environment written against verifiers' public v1 API only (no jaxflow import): one reply,
rewarded 1.0 when its <answer> is an even integer, plus 0.5 (a reward of weight 0.5) when it has an
<answer> at all; its length is a metric, which counts for no reward. Any policy learns it within a few
steps, so a short run shows whether episodes through the adapter learn at all. Loaded by its verifiers
id, this module's name ("verifiers_even_env"), as an installed environment package is."""

import asyncio
import re
import weakref

import openai
import verifiers.v1 as vf

__all__ = ["EvenTaskset", "OneTurnHarness"]

ANSWER = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def last_reply(trace: vf.Trace) -> str:
    replies = trace.assistant_messages
    return (replies[-1].content or "") if replies else ""


class EvenData(vf.TaskData):
    system_prompt: str | None = "Show your work, then give the final answer in <answer> </answer> tags."


class EvenTask(vf.Task[EvenData]):
    @vf.reward(weight=1.0)
    async def even(self, trace: vf.Trace) -> float:
        match = ANSWER.search(last_reply(trace))
        return 1.0 if match is not None and int(match.group(1)) % 2 == 0 else 0.0

    @vf.reward(weight=0.5)
    async def tagged(self, trace: vf.Trace) -> float:
        return 1.0 if ANSWER.search(last_reply(trace)) else 0.0

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(last_reply(trace)))


class EvenTaskset(vf.Taskset[EvenTask, vf.TasksetConfig]):
    def load(self) -> list[EvenTask]:
        return [EvenTask(EvenData(prompt=f"Name an even number near {n}.")) for n in range(8)]


class OneTurnHarness(vf.Harness[vf.HarnessConfig]):
    """One chat completion, run in process (every model call through the rollout's endpoint)."""

    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        system, prompt = self.resolve_prompt(data)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        client = _client().with_options(base_url=endpoint, api_key=secret)
        reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its client


def _client() -> openai.AsyncOpenAI:
    """One client per event loop, shared by its rollouts (each a copy with its own endpoint and token)."""
    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = openai.AsyncOpenAI(base_url="http://127.0.0.1", api_key="none", max_retries=0)
    return _clients[loop]
