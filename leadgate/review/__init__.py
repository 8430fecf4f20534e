"""Lead Review: the lead runner, verdicts, human decisions and the actionable queue."""
