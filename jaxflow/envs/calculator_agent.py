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
import weakref

from jaxflow.envs.calculator import TOOL_CLOSE, TOOL_OPEN, evaluate, tool_calls

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
    client = _client().with_options(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": task["question"]}]
    calls = 0
    while True:
        reply = await client.chat.completions.create(model=model, messages=messages, stop=[TOOL_CLOSE])
        choice = reply.choices[0]
        text = choice.message.content or ""
        # A stop sequence is left out of the reply's text (the API's rule); the turn the model wrote ends
        # with it, so it goes back into the history as written.
        called = choice.finish_reason == "stop" and TOOL_OPEN in text and not text.endswith(TOOL_CLOSE)
        turn = text + TOOL_CLOSE if called else text
        found = tool_calls(turn)
        if not found or calls >= max_calls:
            return float(score(turn, task))
        calls += 1
        if latency_s:
            await asyncio.sleep(latency_s)
        try:
            answer = evaluate(found[-1])
        except (ValueError, ZeroDivisionError) as e:
            answer = f"error: {'division by zero' if isinstance(e, ZeroDivisionError) else e}"
        messages += [{"role": "assistant", "content": turn},
                     {"role": "tool", "content": f"<result>{answer}</result>"}]


_clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its client


def _client():
    """One client per event loop, its connections shared by the episodes on that loop (each episode a copy
    with its own base URL and key, `with_options`): as an agent program keeps one client, not one a call."""
    import openai

    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        # No retries: a refused request is the episode's answer. The timeout covers a turn that waits for a
        # weight update on a busy machine.
        client = _clients[loop] = openai.AsyncOpenAI(base_url="http://127.0.0.1", api_key="none", max_retries=0,
                                                      timeout=600.0)
    return client
