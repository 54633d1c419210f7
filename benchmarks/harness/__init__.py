"""What every benchmark shares, one concern per module.

- ``paths``: where the checkout, the benchmarks and their results are (and the checkout on ``sys.path``).
- ``launch``: one ``mpiexec`` job with a timeout; a job that fails or times out is an outcome, not an error.
- ``stamp``: commit (and whether the tree was dirty), UTC time, load average, machine and versions.
- ``rows``: the jsonl results file: a ``meta`` line, one stamped line per row as it finishes, ``meta_end``.
- ``repeats``: interleaved repeats (repeat 1 of every row, then repeat 2, ...).
- ``summary``: median and spread of repeats; ratios of two rows with the range their spreads allow.
- ``markdown``: tables, cells and the report's header lines.
- ``plots``: matplotlib, where it is installed, and grouped bars.

A benchmark script keeps what is its own (its rows, its worker, its report's tables) and takes the rest here.
"""
