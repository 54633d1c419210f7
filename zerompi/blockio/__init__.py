"""Block I/O and the host memory it moves, shared by swap files (offload/) and checkpoints
(checkpoint/rawio.py): aligned buffers and tensors (aligned.py), the one O_DIRECT path with its
fallback, full-length loops and staging (direct.py), and what goes back to the OS (memory.py)."""
