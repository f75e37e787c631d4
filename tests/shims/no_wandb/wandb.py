"""A machine without wandb, for tests: with this folder first on PYTHONPATH, `import wandb`
finds this module instead of the installed package and fails as a missing package does."""
raise ModuleNotFoundError("No module named 'wandb'", name="wandb")
