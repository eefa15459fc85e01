"""The placement planner under its first module path, kept working for the commands users have:
``python -m diffusers_zero3.plan PIPELINE ...`` is ``diffusers-zero3-plan PIPELINE ...`` (the
console entry point) and ``python -m diffusers_zero3.placement.plan``."""

import sys

from .placement.plan import main

if __name__ == "__main__":
    sys.exit(main())
