"""HTTP surfaces: OpenAI-compatible REST, agents API, hosted MCP, operator API, console."""
