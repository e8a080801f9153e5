"""``python -m gossipd.node.cli``: the ``gossipd`` command without its console script."""

import sys

from gossipd.node.cli.main import main

sys.exit(main())
