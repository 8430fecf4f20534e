"""The ``leadgate`` command line (``main.main`` is the console entry point)."""
