"""``python -m verl_comm.cli ...``: the ``verl-comm`` command."""

import sys

from verl_comm.cli import main

if __name__ == "__main__":
    sys.exit(main())
