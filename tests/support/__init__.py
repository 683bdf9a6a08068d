"""The helpers shared by test modules (one place: no test module imports another)."""
