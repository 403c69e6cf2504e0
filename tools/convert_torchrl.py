#!/usr/bin/env python
"""Convert a torchrl dataset into an mmbuffer store: `python tools/convert_torchrl.py SRC DST [--overwrite ...]`.

The same code as `mmbuffer convert torchrl SRC DST` (see `mmbuffer.convert`); `--help` lists the options.
"""

import sys

from mmbuffer._cli.convert import tool_main

if __name__ == "__main__":
    sys.exit(tool_main("torchrl"))
