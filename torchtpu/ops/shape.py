"""shape lowerings."""
