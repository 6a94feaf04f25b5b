"""rlcli: reinforcement-learning post-training of language models, from one config-driven command."""

__version__ = "0.1.0"
