"""The drafter core: the model, its mask and config, the target and its features, the reference loop, tau."""
