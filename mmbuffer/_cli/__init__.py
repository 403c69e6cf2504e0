"""The ``mmbuffer`` command line: main, convert, demo."""
