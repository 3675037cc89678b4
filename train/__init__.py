"""Generic trainer (docs/design.md 5): optimizer, train state and step (gradient accumulation), Orbax
checkpoints with exact resume, logging, the loop. It knows nothing of the SFT recipe.

Submodules import lazily (wandb and Orbax are heavy); use e.g. ``from train.step import make_train_step``.
"""
