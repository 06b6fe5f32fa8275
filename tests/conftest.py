from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests import FAST_EXAMPLES

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
# scripts/test.sh --fast: a few examples each, for the edit-and-run loop.
settings.register_profile(
    "fast",
    max_examples=FAST_EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("FSDPCHECK_HYPOTHESIS", "ci"))


@pytest.fixture(scope="session")
def spawns(tmp_path_factory, request):
    """The multi-rank scenario runs (tests/dist_harness.py): one spawn per world size."""
    from tests.dist_harness import Spawns

    spawns = Spawns(tmp_path_factory.mktemp("spawns"), request.session.items)
    if "tests.dist.s3.s3_scenarios" in spawns.wanted:
        # Its ranks read from it: up before they start (its tests skip without it).
        with contextlib.suppress(pytest.skip.Exception):
            request.getfixturevalue("s3_server")
    return spawns


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """moto's S3 server on 127.0.0.1, behind the test proxy, for the session (tests/s3_server.py).

    Every S3 client of the session reaches it through the environment (this process and the
    ranks it spawns): ``AWS_ENDPOINT_URL`` is the proxy's port 0, the credentials are moto's, and
    ``FSDPCHECK_TEST_S3`` (JSON) names moto itself, the proxy's port per rank (1 + rank) and
    the bucket. The server is stopped by its pid at the end.
    """
    pytest.importorskip("moto", reason="moto[server] is not installed (scripts/setup.sh)")
    pytest.importorskip("s3fs", reason="s3fs is not installed (scripts/setup.sh)")
    import json

    from tests.s3_server import BUCKET, CREDENTIALS, MotoServer, Proxy

    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    proxy = Proxy(server.port, tags=5)
    env = {
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": proxy.urls[0],
        "FSDPCHECK_TEST_S3": json.dumps(
            {"moto": server.url, "proxy": proxy.urls, "bucket": BUCKET}
        ),
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import fsspec

        fsspec.filesystem("s3", endpoint_url=server.url, skip_instance_cache=True).mkdir(BUCKET)
        yield server, proxy
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        proxy.close()
        server.stop()


# The folder a test module lives in is its marker (registered in pyproject.toml):
#   unit     one process, no subprocess launch of ranks: the kernels, readers, pairing, reports
#   hostile  hostile and changing input: every reader's refusals, fuzzing, kills mid-write
#   process  the console script and the demo as processes (pipes, signals, memory caps)
#   dist     several gloo ranks (tests/dist_harness.py), one folder per subject
#   corpus   checkpoints written by the libraries' own save and conversion code at test time
#   storage  object storage against a real S3-compatible server the suite starts
# `scripts/test.sh --fast` runs unit and hostile without the tests marked slow.
FOLDERS = ("unit", "hostile", "process", "dist", "corpus", "storage")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).resolve().parent
    for item in items:
        parts = Path(str(item.path)).resolve().relative_to(here).parts
        if len(parts) < 2 or parts[0] not in FOLDERS:
            raise pytest.UsageError(
                f"{item.nodeid}: a test module belongs in one of tests/{{{','.join(FOLDERS)}}}/ "
                "(its folder is its marker; see tests/conftest.py)"
            )
        item.add_marker(getattr(pytest.mark, parts[0]))
