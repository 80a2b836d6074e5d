"""`python -m fleetsim ...` = `fairlane simulate ...`."""

import sys

from fleetsim.cli import cmd_simulate

if __name__ == "__main__":
    sys.exit(cmd_simulate(sys.argv[1:]))
