"""What the device reports becomes: the pump, violations, verdicts, logs, exports and metrics."""
