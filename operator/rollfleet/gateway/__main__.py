"""`python -m rollfleet.gateway`: the same as `rollfleet gateway`."""

import argparse
import sys

from rollfleet.gateway.server import add_arguments, run

parser = argparse.ArgumentParser(prog="rollfleet gateway")
add_arguments(parser)
sys.exit(run(parser.parse_args()))
