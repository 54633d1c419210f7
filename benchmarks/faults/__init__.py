"""Faults injected into real jobs, and what is left after them (benchmarks/reliability.py runs them).

- ``ranks``: a rank SIGKILLed, raising, or stuck outside a collective, in real mpiexec jobs.
- ``saves``: a saving child SIGKILLed at each step of the save protocol, or at random moments.
- ``fuzz``: the fuzz tests' counts of damaged checkpoints and configs.
- ``report``: reliability.md from their results; ``findings.md``: the bugs they found, in prose.
"""
