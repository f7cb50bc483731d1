"""Rollout side of jaxflow: the `Engine` interface (engine.py) and its engines (vLLM, jaxflow's JAX engine);
the episodes run on them (episodes.py: jaxflow's environments; agent_engine.py: agent programs through the
OpenAI-compatible endpoint, openai_endpoint.py and agent_session.py); a distillation teacher scoring finished
samples beside them (teacher.py); the driver that runs them is `jaxflow.coordination`."""
