"""A model-free engine and tokenizer: episodes, environments and the services run through their real code
with scripted model turns, so an environment can be checked (its deadlines, its answers, its failures)
without a model, and tests and soaks need no compile.

    engine = EpisodeEngine(ScriptedEngine(lambda request: [104, 105, 35]), make_env, CharTokenizer(),
                           turn_stop_ids=[ord("#")])

`ScriptedEngine` completes each request at once with the turn its script gives for the request, cut at
the request's `max_tokens`, at the engine's version; `CharTokenizer` maps each character to its code point.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from rollout_bridge.engine import Completion, Engine, EngineLoad, Request

__all__ = ["CharTokenizer", "ScriptedEngine"]


class CharTokenizer:
    """One token per character (its code point), a ChatML-like chat template, and `specials`: ids that
    decode to a longer text ({id: text}; encoding never produces them)."""

    eos_id = None

    def __init__(self, specials: Mapping[int, str] | None = None):
        self.specials = dict(specials or {})

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.specials.get(i) or chr(i) for i in ids)

    def id_to_token(self, i: int) -> str:
        return self.decode([i])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, **kwargs) -> str:
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class ScriptedEngine(Engine):
    """Completes every request at once with `script(request)`'s tokens (one model turn), cut at the request's
    max_tokens: finish_reason "stop" when the whole turn fit, else "length". Each token has log-prob
    `logprob` and the engine's `version`, which `update_weights` sets."""

    paused = False

    def __init__(self, script: Callable[[Request], Sequence[int]], *, logprob: float = -0.5):
        self.script, self.logprob, self._version = script, logprob, 0
        self._init_admission()

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, version: int) -> None:  # a test or soak may set the weights' version directly
        self._version = version

    def _invalid(self, request: Request) -> None:
        return None

    def _in_flight(self, request_id: str) -> bool:
        return False

    def _accept(self, request, sample) -> None:
        turn = list(self.script(request))
        ids = turn[:request.params.max_tokens - len(sample.tokens)]
        sample.tokens += ids
        sample.logprobs += [self.logprob] * len(ids)
        sample.versions += [self.version] * len(ids)
        sample.finish_reason = "stop" if len(ids) == len(turn) else "length"
        self._hand_out(Completion(request.request_id, sample))

    def abort(self, request_ids) -> list[Completion]:
        return []  # nothing is ever in flight: each turn completes as it is submitted

    def progress(self, request_ids) -> list[Completion]:
        return []

    def update_weights(self, version: int, tensors, *, keep_kv: bool = False) -> None:
        self._version = version

    def pause(self, mode: str = "keep") -> list[Completion]:
        return []

    def resume(self) -> None:
        pass

    def load(self) -> EngineLoad:
        return EngineLoad(0, 0, 0.0, 0.0, 0)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._finished.notify_all()
