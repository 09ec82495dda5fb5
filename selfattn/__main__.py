from selfattn.cli import run

run()
