"""RL maths for GRPO-family training: group-relative advantages and the clipped policy loss."""
