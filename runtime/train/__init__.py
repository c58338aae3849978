"""Training: the typed train state, the pure step, loss, optimizer, evaluator and the host loop."""
