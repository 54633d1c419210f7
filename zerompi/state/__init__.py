"""The vocabulary in which components declare their checkpointed state (declared.py); it imports nothing
of zerompi, so every folder may use it and checkpoint/ stays above the state it reads and writes."""
