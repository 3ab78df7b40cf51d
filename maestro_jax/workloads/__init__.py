"""Built-in workloads, each described once: its section graph, cost, sample schema."""
