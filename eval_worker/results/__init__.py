"""Results: the ledger on disk, a run's results, the sinks (W&B), the HTML report."""
