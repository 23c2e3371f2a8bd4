"""fused_dense's benchmarks (bench/README.md): run.py (the MLP benchmark) and parallel_mlp.py."""
