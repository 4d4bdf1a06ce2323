"""``python -m joynexus.ops.cli``: the ``joynexus`` command (how role processes are spawned)."""

import sys

from joynexus.ops.cli.app import main

sys.exit(main())
