"""The calculator task as a plain agent program: the `openai` client and a tool loop, nothing of jaxflow's.

This is what a user brings to jaxflow's agent episodes (`rollout.env.kind = "agent"`): an async function
that gets the base URL of an OpenAI-compatible endpoint, the task (its meta) and the episode's id, talks
to the model through chat completions, and returns a reward. jaxflow records the tokens behind each reply
at the endpoint; the agent never sees a token.

    reward = await agent("http://127.0.0.1:8431/episodes/e1/v1", {"question": "Compute 7 + 5 * 3.",
                         "answer": 22}, "e1", api_key=token)

Each model turn stops at the end of its turn or at "</tool>" (the request's `stop`). A turn that calls the
calculator (`<tool>7 + 5 * 3</tool>`) is answered with a tool message `<result>22</result>`; a turn without
a call is the final answer, scored by the arithmetic task's reward. The same episode as the native
environment's (`jaxflow.envs.calculator.CalculatorEnv`), written as an agent would write it.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref

from jaxflow.envs.calculator import TOOL_CLOSE, tool_calls, tool_result, written_turn

__all__ = ["agent"]


async def agent(base_url: str, task: dict, episode: str, *, api_key: str = "none", model: str = "policy",
                latency_s: float = 0.0, max_calls: int = 2, reward_ref: str = "jaxflow.tasks.arithmetic:reward",
                ) -> float:
    """Runs one episode of the calculator task against the endpoint at `base_url`; returns its reward.

    task: the arithmetic task's meta ({"question", "answer", ...}). latency_s: seconds each tool call
    waits (a remote tool). max_calls: tool calls answered; the turn after them is scored as it stands.
    """
    from jaxflow.rewards import resolve

    score = resolve(reward_ref)
    async with _client(base_url, api_key) as client:
        return await _episode(client, task, score, model, latency_s, max_calls)


async def _episode(client, task: dict, score, model: str, latency_s: float, max_calls: int) -> float:
    messages = [{"role": "user", "content": task["question"]}]
    calls = 0
    while True:
        reply = await client.chat.completions.create(model=model, messages=messages, stop=[TOOL_CLOSE])
        choice = reply.choices[0]
        # The turn goes back into the history as the model wrote it (with the stop sequence the API left out).
        turn = written_turn(choice.message.content or "", choice.finish_reason)
        found = tool_calls(turn)
        if not found or calls >= max_calls:
            return float(score(turn, task))
        calls += 1
        if latency_s:
            await asyncio.sleep(latency_s)
        messages += [{"role": "assistant", "content": turn}, {"role": "tool", "content": tool_result(found[-1])}]


class _Shared:
    """An event loop's client and how many of its episodes are using it (closed when none is)."""

    def __init__(self, client):
        self.client, self.users = client, 0


_shared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> the client its episodes share


@contextlib.asynccontextmanager
async def _client(base_url: str, api_key: str):
    """A client for one episode: a copy (its own base URL and key, `with_options`) of one client that the
    episodes running on this event loop share, as an agent program keeps one client, not one a call (a
    client is costly to make). The shared client is closed when its last episode ends.

    Its HTTP transport is aiohttp's (`openai.DefaultAioHttpClient`, the `openai[aiohttp]` extra) where it is
    installed: with hundreds of episodes' connections in one pool, httpx's default pool spends more CPU per
    request than the whole endpoint serving it (it scans every connection on each request)."""
    import openai

    loop = asyncio.get_running_loop()
    shared = _shared.get(loop)
    if shared is None:
        try:
            http = openai.DefaultAioHttpClient(timeout=600.0)
        except RuntimeError:  # the aiohttp extra is absent: httpx's default pool
            http = None
        # No retries: a refused request is the episode's answer. The timeout covers a turn that waits for a
        # weight update on a busy machine.
        shared = _shared[loop] = _Shared(openai.AsyncOpenAI(base_url="http://127.0.0.1", api_key="none",
                                                             max_retries=0, timeout=600.0, http_client=http))
    shared.users += 1
    try:
        yield shared.client.with_options(base_url=base_url, api_key=api_key)
    finally:
        shared.users -= 1
        if shared.users == 0:
            if _shared.get(loop) is shared:
                del _shared[loop]
            await shared.client.close()
