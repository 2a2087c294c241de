"""The algorithm: Draft-OPD losses, packed replay, reference speculative decoding, simulated rollouts."""
