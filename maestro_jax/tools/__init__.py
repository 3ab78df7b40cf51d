"""Tools around the runtime: equivalence check, benchmarks, cost calibration, traces, compiled
memory, Hugging Face import and export."""
