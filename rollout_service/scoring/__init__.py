"""Scoring: reward functions (TRL's signature) and the advantages of a finished group."""
