"""Agentic RL post-training: tool environments, rollouts, GRPO."""
