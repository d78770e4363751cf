"""pdserve: the command line, settings and the launcher; the worker process is worker/ (pdserve.worker)."""
