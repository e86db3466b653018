"""Checkpoints: save/load, the published-checkpoint contract, object stores and the Hub, other trainers' states."""
