"""jaxflow: asynchronous, staleness-constrained RL post-training of LLMs in JAX.

See README.md for the architecture and ../shared/DESIGN.md for the protocol and the loss.
"""

__version__ = "0.1.0"
