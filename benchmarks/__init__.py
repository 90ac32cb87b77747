"""Benchmarks of trtllm_glm, run as ``python -m benchmarks.<name>`` from the repository root; shared code in
`benchmarks.harness`."""
