"""``python -m treadle``: the same as the ``treadle`` command."""

from treadle.cli import main

main()
