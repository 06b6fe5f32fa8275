from fsdpcheck.cli import run

run()
