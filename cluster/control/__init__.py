"""Floor above the gateway, beside autoscale and loadgen: the controller, its instances, the router's clients."""
