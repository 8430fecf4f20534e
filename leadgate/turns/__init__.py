"""The turn path: intake, the model runtime with complete_task, gating, history, providers."""
