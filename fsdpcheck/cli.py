"""The fsdpcheck command line.

Examples:
    fsdpcheck demo            # the embedded demo: faults planted in a sharded model, all caught
    fsdpcheck info            # which backends (CPU SIMD level, CUDA archs) were compiled
    python -m fsdpcheck demo  # the same, without the console script
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fsdpcheck`` and ``python -m fsdpcheck``.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit code: 0 all good, 1 a mismatch or finding, 2 bad usage.
    """
    parser = argparse.ArgumentParser(
        prog="fsdpcheck",
        description="Verify that every rank's shard of a sharded PyTorch checkpoint holds "
        "exactly the right values.",
        epilog=__doc__.split("\n", 2)[2] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("demo", help="run the embedded demo (exit 0 when every outcome is as expected)")
    sub.add_parser("info", help="print which backends were compiled, as JSON")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from fsdpcheck import demo

        return demo.main()
    if args.command == "info":
        from fsdpcheck import build_info

        print(json.dumps(build_info(), indent=2))
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
