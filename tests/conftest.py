"""Settings shared by every test."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# No per-example deadline: a loaded 2-core CI machine would trip it at random.
# In CI the examples are derandomized, so a run can't fail by chance; locally
# they stay random so new counterexamples keep being looked for.
settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")
