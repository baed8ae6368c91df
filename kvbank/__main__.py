"""`python -m kvbank` runs the `kvbank` command line."""

from kvbank.cli import run

run()
