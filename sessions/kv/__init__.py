"""Where sessions' KV lives between turns: the slot table, parked KV (RAM and disk), the
shared-prefix cache, and the residency that moves KV between them (model thread only)."""
