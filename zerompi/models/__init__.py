"""Small example models used by the jobs and benchmarks."""
