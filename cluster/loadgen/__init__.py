"""Floor above the gateway, beside control and autoscale: `pdserve bench`'s load generator and its report."""
