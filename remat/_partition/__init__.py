"""Choosing what is kept: asking the policy (the only place it is asked, eager or compiled), partitioning, budgets, offloading, costs, the lowering under torch.compile. Imports _trace and _core."""
