"""``python -m accelerate_rewrite``: the same as the ``accelerate-rewrite`` command."""

from accelerate_rewrite.cli import console

if __name__ == "__main__":
    console()
