"""Control-plane floor, beside control and loadgen: autoscaling policies, their loop, actuators, profiler."""
