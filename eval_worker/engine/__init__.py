"""The measurement engine: suites, references, drafting, scoring, metrics, diagnostics, speed -> one EvalResult."""
