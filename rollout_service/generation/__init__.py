"""Generation: the slots, the scheduler that fills them with groups, and the episodes that run in them."""
