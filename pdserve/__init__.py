"""pdserve: the command line, settings, worker processes and launcher."""
