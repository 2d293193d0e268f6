"""Tools over benchmark runs: matrix (the throughput matrix, measured one combination a process) and compare (its
table, CSV and chart)."""
