"""reduction lowerings."""
