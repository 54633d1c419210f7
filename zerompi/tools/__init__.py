"""Command-line tools: the ``zerompi`` command, ``zerompi estimate`` and ``zerompi plot``."""
