"""Command-line tools: the ``zerompi`` command and ``zerompi estimate``."""
