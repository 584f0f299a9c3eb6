"""The run's data: prompts into the service, scored groups out of its stream, and the batches made of them."""
