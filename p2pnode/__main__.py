"""``python -m p2pnode`` == the ``p2pnode`` console script."""

import sys

from p2pnode.cli import main

if __name__ == "__main__":
    sys.exit(main())
