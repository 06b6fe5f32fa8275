from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# CI runs a fixed, moderate number of examples; FSDPCHECK_HYPOTHESIS=thorough runs many more.
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=1500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("FSDPCHECK_HYPOTHESIS", "ci"))
