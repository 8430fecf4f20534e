"""leadgate engine: config, database, organizations, agents, work items and turns."""
