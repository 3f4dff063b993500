"""Tenants: keys, the directory shared through Redis, rate limits and the admin audit log."""
