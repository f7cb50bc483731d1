"""jaxflow: asynchronous, staleness-constrained RL post-training of LLMs in JAX.

The packages, from the top of the import layers down (the `[tool.importlinter]` contract in pyproject.toml
checks them in the test suite): `jobs` (what `python -m jaxflow.main` runs), `sim` and `coordination` (the
rollout driver and its strategies), `rollout_bridge` beside `transport` (engines; the wire and RPC),
`trainer` (batch, losses, the update step), `data` (records and the trajectory and parameter services),
and at the bottom `models`, `tasks`, `rewards`, `sharding`, `tokenizer`, `config`. README.md's layout and
docs/design.md walk through them.
"""
