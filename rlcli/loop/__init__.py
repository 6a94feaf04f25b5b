"""The one training loop and what it carries: the trainer (rollout → reward → shaping → scoring → advantage → update),
the learner's engines, the carried state and its checkpoints, held-out evaluation, metrics, the start-up summary and
the training curves (docs/design.md#layers)."""
