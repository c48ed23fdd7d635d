"""An SGLang-compatible HTTP server with a continuous-batching capacity model, for no-GPU runs."""
