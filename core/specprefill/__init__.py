"""SpecPrefill policy: the tool guard, the planner and its cost model, scoring, selection,
sparse prefill (pure numpy except prefill)."""
