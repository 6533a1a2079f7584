"""Top floor of the cluster (only bench/ above): the `pdserve` command line, its processes, the controller's app."""
