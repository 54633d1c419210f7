"""Processes and collectives: the process-group protocol (group.py) and its MPI implementation
(mpi/, whose library.py is the package's only mpi4py user), the shared counters and debug agreement (monitor.py),
the hang recorder, watchdog and report (recorder.py, watchdog.py, diagnosis.py), the
communication thread, node-aware groups (topology.py) and launch discovery."""
