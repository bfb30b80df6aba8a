"""Benchmarks and planning, built on the engine's public API: seeded random workloads and
Poisson arrivals (workload.py), the FCFS-vs-deadline matrix (slo_matrix.py), the capacity
report (capacity.py), and the command-line modes that run them, their flags and checks (cli.py)."""
