"""The async API's queue and the workers that run its jobs."""
