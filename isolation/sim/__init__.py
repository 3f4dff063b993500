"""A small, fast look-alike of vLLM's OpenAI-compatible server, for tests, demos and benchmarks."""

from isolation.sim.app import create_sim_app
from isolation.sim.config import FAULTS, Fault, SimConfig

__all__ = ["FAULTS", "Fault", "SimConfig", "create_sim_app"]
