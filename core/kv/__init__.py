"""What a session holds in each model's KV cache (``positions``) and a slot's KV as one
unit that is saved, restored or started from a shared prefix (``slot_cells``)."""
