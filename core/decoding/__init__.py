"""Decoding: sampling and the token loop, constrained replies, speculative decoding,
SpecAttn, acceptance and stop strings."""
