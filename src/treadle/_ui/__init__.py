"""The run console of ``treadle ui``: a local web app over one store (docs/ui.md).

Its packages come with the ``ui`` extra (``pip install 'treadle[ui]'``); nothing else in
treadle imports this package.
"""
