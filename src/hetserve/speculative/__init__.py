"""Speculative decoding: a draft model proposes, the target verifies in one forward."""
