"""rhymerl: RL training of LLMs with a fast rollout engine."""

__version__ = "0.1.0"
