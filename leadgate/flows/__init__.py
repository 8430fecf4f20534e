"""ActionFlows: ordered nodes; an Action Agent node with a lead pauses the flow (SPEC 9)."""
