"""The training front end: config, data, trainer, checkpoints, metrics."""
