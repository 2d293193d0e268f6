"""Tools over benchmark runs: compare (the throughput matrix's table, CSV and chart) and the kernel benchmarks' GPU
timing (timing)."""
