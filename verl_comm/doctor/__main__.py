"""``python -m verl_comm.doctor ...``: the same as ``verl-comm doctor ...``."""

import sys

from verl_comm.doctor import main

if __name__ == "__main__":
    sys.exit(main())
