"""``python -m accelerate_rewrite``: the same as the ``accelerate-rewrite`` command."""

from accelerate_rewrite.cli import main

if __name__ == "__main__":
    main()
