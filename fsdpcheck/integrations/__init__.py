"""Integrations with training frameworks (imported on demand)."""
