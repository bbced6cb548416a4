"""Workers: where a step runs (executors, worker processes and ranks, the model runner and its KV cache)."""
