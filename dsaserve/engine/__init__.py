"""The engine: the step loop (LLMEngine, AsyncLLMEngine) and its request bookkeeping (admission, outputs, stats)."""
