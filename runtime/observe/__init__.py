"""Observability derived from the run's records: metric sinks, profiles, goodput, plots."""
