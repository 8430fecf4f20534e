"""Background runners that drive the turn path: revision dispatch and schedules.

(The lead runner lives in :mod:`leadgate.review`, the relay in :mod:`outbox`, the
abandonment sweeper with the work items in :mod:`leadgate.domain.workitems`.)
"""
