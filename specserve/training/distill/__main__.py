"""`python -m specserve.training.distill`: the commands of cli.py."""

from specserve.training.distill.cli import main

if __name__ == "__main__":
    main()
