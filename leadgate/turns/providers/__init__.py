"""Model providers: the built-in ``script`` model and OpenAI-compatible servers."""
