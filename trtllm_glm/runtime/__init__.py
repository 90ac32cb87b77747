"""Runtime: requests, scheduling, execution, sampling and the LLM API."""
