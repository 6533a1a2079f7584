"""Control-plane floor, beside control and autoscale: `pdserve bench`'s load generator and its report."""
