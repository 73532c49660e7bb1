"""Run `gradsift train` without the full CLI (gradsift.commands.analyze is not there yet)."""

import argparse
import sys

from gradsift.commands import train

parser = argparse.ArgumentParser()
sub = parser.add_subparsers()
train.add_parser(sub)
args = parser.parse_args(["train", *sys.argv[1:]])
sys.exit(args.func(args))
