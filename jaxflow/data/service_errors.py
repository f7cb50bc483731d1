"""The trajectory service's named errors, in a module of their own so that `jaxflow.transport` can register
them for the wire without importing the service (and the prompt source's data loader with it).

`SampleRefused`: `jaxflow.data.checks` refuses a sample or reward the trainer cannot train on; `reason` says
which kind of fault (REFUSAL_REASONS), and the service counts refusals by it. `ConsumeSuperseded`: a waiting
`consume` gave way to a newer call for the same buffer.
"""

from __future__ import annotations

# Why a sample or reward was refused: an id the model cannot embed, more tokens than a trainer row holds, a
# reward (or a group's reward statistics) that is not finite, anything else wrong with the sample.
REFUSAL_REASONS = ("token_id", "length", "reward", "malformed")


class SampleRefused(ValueError):
    """A sample or reward that cannot be trained on. reason: one of REFUSAL_REASONS. The message names the
    group, the sample, the field and the element."""

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


class ConsumeSuperseded(RuntimeError):
    """A `consume` that was still waiting when a newer call for the same buffer arrived (its client gave up
    and asked again): it gives way and takes nothing; the newer call gets the batch."""
