"""What the benchmarks share: timers (`timing`), the copy ceiling and matmul rate (`ceiling`), bytes and FLOP
floors (`floors`), the ``--env-ab`` A/B (`env_ab`), JSON rows and the device line (`rows`), seeded random
models (`models`), profiler breakdowns (`profiling`, `idle_sites`, `sync_sites`)."""
