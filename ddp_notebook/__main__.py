"""``python -m ddp_notebook demo [--devices cpu*2] [--fail-rank 1]``"""
import sys

from .demo import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "demo":
        args = args[1:]
    sys.exit(main(args))
