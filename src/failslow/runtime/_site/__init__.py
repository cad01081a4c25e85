"""Holds the ``sitecustomize`` that ``failslow run`` puts first on ``PYTHONPATH``."""
