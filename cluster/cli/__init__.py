"""Top floor: the `pdserve` command line, the server processes (`serve`) and the controller's HTTP app."""
