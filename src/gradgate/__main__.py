"""``python -m gradgate`` runs the command line."""

from gradgate.cli import main

raise SystemExit(main())
