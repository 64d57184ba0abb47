"""Kernel benchmark: `python bench/kernels.py [--shapes 4096x896x151936] [--json out.json]`.

Same as `portagrpo bench kernels`; see portagrpo/bench.py for what is measured.
"""
import sys

from portagrpo.tools.bench import main_cli

if __name__ == "__main__":
    sys.exit(main_cli(sys.argv[1:]))
