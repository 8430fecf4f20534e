"""leadgate: AI worker agents behind chat channels, REST and MCP, gated by Lead Review."""
