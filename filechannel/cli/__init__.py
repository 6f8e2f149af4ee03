"""The ``filechannel`` command line (``python -m filechannel``, the ``filechannel`` console script).

Its commands, by what they do (``filechannel COMMAND --help``; docs/cli.md):

- channel commands (``channels.py``): ``put`` (one event per stdin line,
  committed in batches), ``take`` (print and remove events), ``peek`` (print
  without taking), ``checkpoint`` (write a checkpoint now);
- inspection and repair (``inspection.py``): ``stat`` (queue size, positions,
  files, bytes), ``consumers`` (list, remove or reset external consumers),
  ``dump`` (every record as a JSON line), ``verify`` (check every record and
  header; ``--salvage``), ``repair-channel-file`` (rebuild a damaged CHANNEL
  file), ``wal dump`` and ``wal verify`` (a write-ahead log);
- serve and keys (``serving.py``): ``serve`` (an agent over Arrow Flight, with
  its HTTP port and sources), ``keygen`` (create or extend a keystore);
- ``top`` (``top.py``): a live view of channels and agents.

``parser.py`` holds the table of subcommands and adds the arguments they share;
``common.py`` what every command shares; ``main.py`` runs a command and turns
every error into one line on stderr. This package is the only code that prints.
Exit status: 0 success, 1 verify found problems or take's output closed (its
batch rolled back), 2 usage or channel error, 130 interrupted (SIGINT) and 143
terminated (SIGTERM): ``put`` and ``take`` then say exactly what was committed.
"""

from .main import main as main
from .parser import build_parser as build_parser
