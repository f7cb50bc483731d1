"""Prefix reuse across an agent's turns: the prompt tokens each turn prefills, with and without session affinity.

    .venv/bin/python benchmarks/prefix_reuse.py --json benchmarks/results/prefix_reuse.json
    .venv/bin/python benchmarks/prefix_reuse.py --quick

An agent sends its whole conversation with every request, so turn k's prompt is turn k-1's prompt, its reply
and the agent's next message. The JAX engine keeps a finished turn's cache row for the same episode's next
turn (`JaxEngine(reuse_turns=True)`): there the turn computes only its new tokens. That holds only on the
engine that served the turn before. Two tiny JAX engines serve the same episodes three ways:

- `affinity`: an `AgentEngine` over each engine, episodes dealt to them in turn: every turn of an episode
  goes to the engine that served its previous turn (the agent's endpoint belongs to that engine), as jaxflow
  runs agents;
- `round_robin`: one endpoint in front of both engines sends each turn to the other engine than the turn
  before (a stateless load balancer over two engines), so a turn finds at most the row of the turn before
  last, kept on that engine;
- `no_reuse`: `affinity` on engines built with reuse_turns=False, the floor: every turn prefills its whole
  prompt.

The agent (`four_turn_agent`) asks the arithmetic task's question, then answers each reply with a short
message (the calculator's result for a `<tool>` call, else a request to check the answer), four requests
in all, whatever the replies say. Each episode samples with its own seed, the same in every mode, so the
modes see the same conversations, up to rounding. Turns run one at a time and each turn's counts are the
engines' `prefill_stats()` difference around it (`JaxEngine.prefill_stats`): the prompt's cache positions
(`context`: prompt tokens less the one the first decode step feeds), those a kept row already held (`reused`)
and those a prefill or extend computed (`prefilled`). Token counts only: nothing here is timed, so a busy
machine changes none of the figures. A turn that ends at max_tokens ("length") keeps no row, so the turn
after it prefills everything in every mode; `length_turns` counts them.

The model is the tool demo's warm-started base (configs/arithmetic_tools_tiny.py, built on first use into
runs/base/), which ends its turns as the agent's demonstrations taught it. Headline keys:
prefill_tokens_affinity, prefill_tokens_round_robin, prefill_tokens_no_reuse (totals),
prefix_hit_frac_affinity and prefix_hit_frac_round_robin (reused / context), and
prefill_reduction_affinity_vs_round_robin (1 - affinity's prefilled over round robin's); `turns` holds one
row per mode and turn index. --quick runs 8 episodes a mode instead of 32.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import pathlib

import results_meta

MODES = ("affinity", "round_robin", "no_reuse")
TURNS = 4
TURN_TOKENS = 48  # the most tokens the agent asks for a reply
MAX_LEN = 512  # the engines' context: 4 turns with their replies and messages fit
CHECK = "Check your answer, then give it again."


async def four_turn_agent(base_url: str, task: dict, episode: str, *, api_key: str, turns: int = TURNS,
                          max_tokens: int = TURN_TOKENS, stop: tuple[str, ...] = ("</tool>",), on_turn=None,
                          model: str = "policy") -> float:
    """An agent of `turns` requests whatever the replies say: the question, then after each reply the
    calculator's result (a reply that called it) or a request to check the answer. Each reply goes back
    into the history as it came (a stop string left out: the endpoint's session continues the sequence
    either way). stop: the requests' stop strings (each one token). on_turn(episode, k, finish_reason) is
    called after each reply (k = 1..turns). Returns the last reply's reward."""
    import openai

    from jaxflow.envs.calculator import TOOL_CLOSE, TOOL_OPEN, evaluate, tool_calls
    from jaxflow.tasks.arithmetic import reward

    client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600.0)
    messages = [{"role": "user", "content": task["question"]}]
    text = ""
    try:
        for k in range(1, turns + 1):
            reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                                         stop=list(stop))
            choice = reply.choices[0]
            if on_turn is not None:
                on_turn(episode, k, choice.finish_reason)
            text = choice.message.content or ""
            stopped_in_call = choice.finish_reason == "stop" and TOOL_OPEN in text and not text.endswith(TOOL_CLOSE)
            found = tool_calls(text + TOOL_CLOSE if stopped_in_call else text)
            if found:
                try:
                    answer = evaluate(found[-1])
                except (ValueError, ZeroDivisionError) as e:
                    answer = f"error: {e}"
                follow = {"role": "tool", "content": f"<result>{answer}</result>"}
            else:
                follow = {"role": "user", "content": CHECK}
            messages += [{"role": "assistant", "content": text}, follow]
    finally:
        await client.close()
    return float(reward(text, task))


@dataclasses.dataclass
class TurnCount:
    """One turn's counts (module docstring)."""

    episode: str
    turn: int
    context: int
    reused: int
    prefilled: int
    finish_reason: str


class _Counter:
    """Reads both engines' prefill counters around each turn: `on_turn` records the difference since the
    turn before (turns run one at a time, so it is that turn's alone)."""

    def __init__(self, engines):
        self.engines, self.turns = engines, []
        self._last = self._total()

    def _total(self):
        a, b = (e.prefill_stats() for e in self.engines)
        return a + b

    def mark(self) -> None:
        self._last = self._total()

    def on_turn(self, episode: str, k: int, finish_reason: str) -> None:
        now = self._total()
        d, self._last = now - self._last, now
        self.turns.append(TurnCount(episode, k, d.context_tokens, d.reused_tokens, d.computed_tokens, finish_reason))


def run_mode(mode: str, model_dir: pathlib.Path, tasks: list[dict], *, turns: int = TURNS,
             max_tokens: int = TURN_TOKENS, stop: tuple[str, ...] = ("</tool>",), max_len: int = MAX_LEN,
             slots: int = 8) -> list[TurnCount]:
    """Runs `tasks` (arithmetic task metas), one episode each, one at a time, on two fresh JAX engines in
    `mode` (MODES); each turn's counts. turns, max_tokens, stop: the agent's (`four_turn_agent`)."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {MODES}")
    from rollout_bridge.jax_engine import JaxEngine

    engines = [JaxEngine(str(model_dir), max_slots=slots, max_len=max_len, reuse_turns=mode != "no_reuse",
                         warmup=False, seed=i) for i in range(2)]
    counter = _Counter(engines)
    options = dict(turns=turns, max_tokens=max_tokens, stop=tuple(stop), on_turn=counter.on_turn)
    try:
        if mode == "round_robin":
            _round_robin(engines, model_dir, tasks, counter, options, max_len)
        else:
            _affinity(engines, model_dir, tasks, counter, options, max_len)
    finally:
        for e in engines:
            e.close()
    return counter.turns


def _params(i: int, max_len: int):
    """Episode i's sampling: temperature 1 and its own seed, which every turn of it samples with (each
    turn's room in tokens is the agent's request's)."""
    from rollout_bridge.engine import SamplingParams

    return SamplingParams(max_tokens=max_len, temperature=1.0, seed=1000 + i)


def _affinity(engines, model_dir, tasks, counter, options, max_len) -> None:
    """Episodes dealt to an AgentEngine over each engine in turn (module docstring)."""
    from jaxflow.tokenizer import Tokenizer
    from rollout_bridge.agent_engine import AgentEngine, FunctionAgent
    from rollout_bridge.engine import Request

    tokenizer = Tokenizer.from_dir(model_dir)
    agent = FunctionAgent(four_turn_agent, options, ref="prefix_reuse:four_turn_agent")
    agents = [AgentEngine(e, agent, tokenizer, max_context=max_len) for e in engines]
    try:
        for i, task in enumerate(tasks):
            counter.mark()
            (done,) = agents[i % 2].generate([Request(f"ep{i}", [], _params(i, max_len), meta=task)], timeout=600)
            if done.info.get("env_failure"):
                raise RuntimeError(f"episode {i} failed: {done.info.get('env_error')}")
    finally:
        for a in agents:
            a.close()  # closes its engine too


def _round_robin(engines, model_dir, tasks, counter, options, max_len) -> None:
    """One endpoint in front of both engines, each turn sent to the other engine than the turn before."""
    from jaxflow.tokenizer import Tokenizer
    from rollout_bridge.engine import Request
    from rollout_bridge.openai_endpoint import OpenAIEndpoint, SessionBackend

    sent: dict[str, int] = {}  # episode -> turns sent
    index = {f"ep{i}": i for i in range(len(tasks))}

    async def generate(episode_id, prompt, prefix, params):
        i = index[episode_id]
        engine = engines[(i + sent.get(episode_id, 0)) % 2]  # turn 1 where affinity puts the episode
        sent[episode_id] = sent.get(episode_id, 0) + 1
        ep = _params(i, max_len)
        params = dataclasses.replace(params, temperature=ep.temperature, seed=ep.seed)  # as AgentEngine does
        (done,) = await asyncio.to_thread(engine.generate, [Request(episode_id, prompt, params, prefix=prefix)], 600)
        return done.sample

    backend = SessionBackend(Tokenizer.from_dir(model_dir), generate, max_context=max_len)
    with OpenAIEndpoint(backend, model="policy") as endpoint:
        for i, task in enumerate(tasks):
            eid = f"ep{i}"
            backend.open(eid)
            counter.mark()
            asyncio.run(four_turn_agent(endpoint.episode_url(eid), task, eid, api_key=endpoint.token, **options))
            backend.end(eid)
            for e in engines:
                e.release([eid])  # the episode ended: as AgentEngine releases it


def summarize(counts: dict[str, list[TurnCount]], turns: int = TURNS) -> dict:
    """The figures (module docstring) from each mode's turn counts."""
    rows, totals = [], {}
    for mode, tc in counts.items():
        for k in range(1, turns + 1):
            at = [t for t in tc if t.turn == k]
            context, reused = sum(t.context for t in at), sum(t.reused for t in at)
            rows.append({"mode": mode, "turn": k, "turns": len(at), "context_tokens": context,
                         "reused_tokens": reused, "prefill_tokens": sum(t.prefilled for t in at),
                         "prefix_hit_frac": reused / max(context, 1),
                         "length_turns": sum(t.finish_reason == "length" for t in at)})
        context, reused, prefilled = (sum(getattr(t, f) for t in tc) for f in ("context", "reused", "prefilled"))
        totals[mode] = {"turns": len(tc), "context_tokens": context, "reused_tokens": reused,
                        "prefill_tokens": prefilled, "prefix_hit_frac": reused / max(context, 1),
                        "length_turns": sum(t.finish_reason == "length" for t in tc)}
    out = {f"prefill_tokens_{m}": t["prefill_tokens"] for m, t in totals.items()}
    out.update({f"prefix_hit_frac_{m}": t["prefix_hit_frac"] for m, t in totals.items() if m != "no_reuse"})
    if {"affinity", "round_robin"} <= set(totals):
        out["prefill_reduction_affinity_vs_round_robin"] = (
            1 - totals["affinity"]["prefill_tokens"] / max(totals["round_robin"]["prefill_tokens"], 1))
    return {**out, "totals": totals, "turns": rows}


def model_dir() -> pathlib.Path:
    """The tool demo's warm-started base, built on first use (module docstring)."""
    from jaxflow.config import load_config
    from jaxflow.jobs.warm_start import ensure_base_model

    return ensure_base_model(load_config(str(results_meta.ROOT / "configs" / "arithmetic_tools_tiny.py"), {}))


def tasks_of(n: int, seed: int = 0) -> list[dict]:
    """`n` eval problems of the tool demo's arithmetic task."""
    from jaxflow.config import load_config
    from jaxflow.jobs.warm_start import make_task

    config = load_config(str(results_meta.ROOT / "configs" / "arithmetic_tools_tiny.py"), {})
    return make_task(config).examples("eval", n, seed)


def build_parser() -> argparse.ArgumentParser:
    """The command line (importable, so tests parse the documented commands without running them)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 episodes a mode instead of 32 (< 5 min)")
    parser.add_argument("--json", type=pathlib.Path, help="write the figures here")
    parser.add_argument("--episodes", type=int, help="episodes a mode (default 32; quick: 8)")
    parser.add_argument("--modes", nargs="+", choices=MODES, help="default: all")
    return parser


def print_table(figures: dict) -> None:
    print(f"\n{'mode':<13}{'turn':>5}{'episodes':>9}{'prompt':>8}{'reused':>8}{'prefilled':>10}{'hit':>7}"
          f"{'length':>7}")
    for r in figures["turns"]:
        print(f"{r['mode']:<13}{r['turn']:>5}{r['turns']:>9}{r['context_tokens']:>8}{r['reused_tokens']:>8}"
              f"{r['prefill_tokens']:>10}{r['prefix_hit_frac']:>7.1%}{r['length_turns']:>7}")
    for mode, t in figures["totals"].items():
        print(f"{mode:<13}{'all':>5}{t['turns']:>9}{t['context_tokens']:>8}{t['reused_tokens']:>8}"
              f"{t['prefill_tokens']:>10}{t['prefix_hit_frac']:>7.1%}{t['length_turns']:>7}")
    if "prefill_reduction_affinity_vs_round_robin" in figures:
        print(f"prefilled tokens, affinity against round robin: "
              f"{-figures['prefill_reduction_affinity_vs_round_robin']:+.1%}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    started = results_meta.begin(argv)
    episodes = args.episodes or (8 if args.quick else 32)
    directory = model_dir()
    tasks = tasks_of(episodes)
    counts = {}
    for mode in args.modes or MODES:
        counts[mode] = run_mode(mode, directory, tasks)
        print(f"  {mode}: {len(counts[mode])} turns", flush=True)
    figures = summarize(counts)
    print_table(figures)
    if args.json:
        results_meta.write_json(str(args.json), {**figures, "episodes": episodes, "turns_per_episode": TURNS,
                                                 "turn_tokens": TURN_TOKENS, "max_len": MAX_LEN,
                                                 "model": str(directory.name), "quick": args.quick}, started)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
