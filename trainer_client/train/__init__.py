"""The training loop: one run against the service, its stream-fed Trainer, and the step machinery around it."""
