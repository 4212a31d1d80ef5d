"""Ways to run a job over rows: local (this process: windows, durable output, resume), ray (Ray Data replicas; needs
the `ray` extra: `pip install -e ".[ray]"`) and remote (a running `slimroute serve`)."""
