"""Rollout side of jaxflow: engine adapters (vLLM, jaxflow's JAX engine), rollout workers, weight receiving."""
