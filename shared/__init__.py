"""budgetq's common package: config, Redis keys, budget scripts, job/result schema."""
