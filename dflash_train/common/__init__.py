"""The project's kernel: settings, the error base, durable file writes, progress, secret redaction."""
