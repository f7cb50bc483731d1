"""An environment's answer as the token ids that continue an episode: the chat template's rendering of the
observation messages between the model's turn and its next one.

The episode already holds the model's tokens as they were sampled (never re-encoded), so only what
comes after them is rendered: the end of the model's turn (when the model stopped at a tool-call marker
rather than at its end-of-turn token), the observation messages, and the header of the next assistant
turn. The template itself says what those are: `ObservationRenderer` renders a probe conversation with
and without the observation and keeps the difference, so any chat template (ChatML, Llama 3, ...) works
without jaxflow knowing its markup.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ObservationRenderer"]

_PROBE_USER, _PROBE_REPLY = "\u2060probe-user\u2060", "\u2060probe-reply\u2060"


class ObservationRenderer:
    """Renders observations with `tokenizer`'s chat template (a `jaxflow.tokenizer.Tokenizer`).

    `ids(messages, turn_closed)`: the token ids to append after a model turn; turn_closed says whether
    the turn already ended with the end-of-turn token (the template's text right after an assistant
    message's content starts with it), else the ids close the turn first. Raises ValueError when the
    template does not render an observation as a plain continuation of the conversation.
    """

    def __init__(self, tokenizer: Any, **template_kwargs: Any):
        self.tokenizer, self.template_kwargs = tokenizer, template_kwargs
        probe = [{"role": "user", "content": _PROBE_USER}, {"role": "assistant", "content": _PROBE_REPLY}]
        self._probe = probe
        self._closed = tokenizer.apply_chat_template(probe, add_generation_prompt=False, **template_kwargs)
        if self._closed.count(_PROBE_REPLY) != 1:
            raise ValueError("the chat template does not render an assistant message's content once")
        # What the template writes after an assistant message's content: the end of its turn.
        self.turn_end = self._closed[self._closed.index(_PROBE_REPLY) + len(_PROBE_REPLY):]
        eos = tokenizer.id_to_token(tokenizer.eos_id) if tokenizer.eos_id is not None else None
        self._after_eos = (self.turn_end[len(eos):] if eos and self.turn_end.startswith(eos) else self.turn_end)

    def text(self, messages: list[dict[str, str]], turn_closed: bool) -> str:
        """The text that follows a model turn (see the class doc)."""
        full = self.tokenizer.apply_chat_template([*self._probe, *messages], add_generation_prompt=True,
                                                  **self.template_kwargs)
        if not full.startswith(self._closed):
            raise ValueError("the chat template renders the conversation before an observation differently "
                             "once the observation is added; cannot append the observation as tokens")
        return (self._after_eos if turn_closed else self.turn_end) + full[len(self._closed):]

    def ids(self, messages: list[dict[str, str]], turn_closed: bool) -> list[int]:
        return self.tokenizer.encode(self.text(messages, turn_closed))
