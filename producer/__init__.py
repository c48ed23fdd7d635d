"""budgetq producer: streams prompts into RQ with back-pressure and collects results to disk."""
