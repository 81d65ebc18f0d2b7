"""The model thread: the worker, the step loop that batches running turns, what a turn asks
of the loop, and the chunk budget."""
