"""budgetq worker: pulls per-prompt RQ jobs and keeps N SGLang requests in flight."""
