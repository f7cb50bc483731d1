"""Environments of multi-turn, tool-using episodes: jaxflow's environment protocol and its checks
(`base`), the calculator tool of the arithmetic demo (`calculator`), the same task as a plain agent program
for the OpenAI-compatible endpoint (`calculator_agent`), and adapters for environments written for other
libraries (`adapters`: SkyRL-gym's `BaseTextEnv`)."""
