"""Tools over benchmark runs: compare (the throughput matrix's table, CSV and chart)."""
