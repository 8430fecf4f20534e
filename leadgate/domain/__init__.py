"""Domain: organizations, keys, users, agents and lead rules, policy, work items, typed rows."""
