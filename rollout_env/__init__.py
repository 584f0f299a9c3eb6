"""Environment runners: standard environment formats driving a run of the rollout service from
their own process (and their own Python environment, when their pins need one)."""
