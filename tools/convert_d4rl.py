#!/usr/bin/env python
"""Convert a d4rl dataset into an mmbuffer store: `python tools/convert_d4rl.py SRC DST [--overwrite ...]`.

The same code as `mmbuffer convert d4rl SRC DST` (see `mmbuffer.convert`); `--help` lists the options.
"""

import sys

from mmbuffer._cli.convert import tool_main

if __name__ == "__main__":
    sys.exit(tool_main("d4rl"))
