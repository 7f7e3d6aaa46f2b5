"""linalg lowerings."""
