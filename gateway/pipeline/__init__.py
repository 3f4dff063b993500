"""One request's path: admit, count, hold a slot, forward through every check, settle."""
