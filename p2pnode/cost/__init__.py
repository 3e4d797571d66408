"""The cost model: what a request costs an engine and what KV costs to move, in one place.

Profiles (``profiles.py``) give one model on one accelerator: the continuous-batching step time, the KV capacity and
the KV bytes per token. Routing prices pulls and prefills with them, the rate plan derives its work unit from them,
the shadow gate replays on them, the CLI names them (``--cost-profile``) and the simulator's engine runs them: every
reader takes the same figures from here.
"""

from p2pnode.cost.profiles import DEFAULT_PROFILE, PROFILES, CostProfile, fixed_step_profile, get_profile

__all__ = ["DEFAULT_PROFILE", "PROFILES", "CostProfile", "fixed_step_profile", "get_profile"]
