from ._cli.main import run

run()
