"""Generation: the slots, the scheduler that fills them with groups, and the episodes
(prompts rendered to token ids; single completions, or conversations with tools and
environments) that run in them against the engine."""
