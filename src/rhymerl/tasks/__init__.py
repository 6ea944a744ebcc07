"""Built-in tasks: prompts generated from a seed, with answers a verifier can check."""
