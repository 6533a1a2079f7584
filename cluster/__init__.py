"""The cluster: the leaves any floor may import here (spec, state), the rest in one subpackage per floor."""
