"""Running a plan: resharding with exact gradient layouts, op wrappers, the distributed module."""
