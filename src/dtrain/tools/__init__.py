"""Tools beside training: `dtrain bench comm` (comm_bench); the planner and timeline to come."""
