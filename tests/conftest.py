from __future__ import annotations

import os

import pytest
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


@pytest.fixture(scope="session")
def spawns(tmp_path_factory, request):
    """The multi-rank scenario runs (tests/dist_harness.py): one spawn per world size."""
    from tests.dist_harness import Spawns

    return Spawns(tmp_path_factory.mktemp("spawns"), request.session.items)
