import os
from pathlib import Path

#: The repository's root (test modules sit one or two folders below tests/).
REPO_ROOT = Path(__file__).resolve().parent.parent

#: Hypothesis examples a test runs in scripts/test.sh --fast (FSDPCHECK_HYPOTHESIS=fast).
FAST_EXAMPLES = 8


def examples(n: int) -> int:
    """`n` for a test that sets its own number of hypothesis examples; at most FAST_EXAMPLES in
    the fast loop (an explicit ``max_examples`` wins over the profile)."""
    return min(n, FAST_EXAMPLES) if os.environ.get("FSDPCHECK_HYPOTHESIS") == "fast" else n
