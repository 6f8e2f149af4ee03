"""``python -m filechannel``: the command-line tool."""

from .cli import main

raise SystemExit(main())
