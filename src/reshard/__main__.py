"""``python -m reshard demo``: the same as the ``reshard`` command."""

from .apps.cli import run

if __name__ == "__main__":
    run()
