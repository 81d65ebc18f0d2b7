"""The byte stores behind the sessions' KV: parked KV (RAM and disk), the shared-prefix
cache, session checkpoints and the KV tier (files or Redis).  They keep bytes, not cells:
the model thread's residency (core.runtime.residency) moves KV between them and the slots,
through the interfaces core/kv/stores.py defines."""
