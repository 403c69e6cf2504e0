#!/usr/bin/env python
"""Convert a minari dataset into an mmbuffer store: `python tools/convert_minari.py SRC DST [--overwrite ...]`.

The same code as `mmbuffer convert minari SRC DST` (see `mmbuffer.convert`); `--help` lists the options.
"""

import sys

from mmbuffer._cli.convert import tool_main

if __name__ == "__main__":
    sys.exit(tool_main("minari"))
