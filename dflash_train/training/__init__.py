"""Training: the loop, its data, anchors and loss, the hidden-state queue, config, state and the `dflash-train` CLI."""
