"""Core: errors, clock and ids, config, limits, shared types, metrics, runner loop."""
