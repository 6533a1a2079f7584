"""Floor above the gateway, beside control and loadgen: autoscaling policies, their loop, actuators, profiler."""
