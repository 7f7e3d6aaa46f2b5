"""Glue that tells other libraries about the tpu device, each installed at
`import torchtpu` without importing the library itself."""
