"""Serving a model: the scheduler, the engine client, the model pool and what a request runs
through (sampling, structured output, speculation, the context cache)."""
