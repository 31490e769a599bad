"""The benchmarks and the simulation: scripts run as `python benchmarks/<name>.py` (benchmarks/README.md
lists the studies and their records in benchmarks/results/), and the modules they share, imported as
`benchmarks.<name>` from the installed project (`pip install -e .`). Benchmark code: operators/ and
pipelines/ never import it."""
