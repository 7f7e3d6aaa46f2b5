"""python -m torchtpu report: the environment, devices, settings and cache,
for a bug report."""
from torchtpu.reporting import main

raise SystemExit(main())
