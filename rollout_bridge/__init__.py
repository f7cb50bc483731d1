"""Rollout side of jaxflow: the `Engine` interface (engine.py) and its engines (vLLM, jaxflow's JAX engine);
the driver that runs them is `jaxflow.coordination`."""
