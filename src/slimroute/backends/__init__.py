"""Ways to run a classification job beyond one process. Each backend imports its engine lazily:
`slimroute.backends.ray` needs the `ray` extra (`pip install -e ".[ray]"`)."""
