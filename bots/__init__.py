"""Channel adapters: thin translators between a platform SDK and the core."""
