"""What `rlcli <command>` runs: the command line, the launcher and its torchrun workers, export, paper ladders,
benchmarks and the GPU smoke test (docs/design.md#layers)."""
