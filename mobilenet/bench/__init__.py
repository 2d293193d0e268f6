"""Tools over benchmark runs: matrix (the throughput matrix, measured one combination a process), compare (its
table, CSV and chart) and timing (the kernel benchmarks' GPU timing)."""
