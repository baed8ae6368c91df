"""`python -m kvbank` runs the `kvbank` command line."""

from kvbank.cli import main

raise SystemExit(main())
