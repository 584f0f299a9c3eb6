"""The pieces of ``benchmarks/bench_vs_trl.py``, one job a module.

- ``outcomes``: a run's curve, and the numbers read off it (time and steps to the target);
- ``trl_side``: a TRL ``GRPOTrainer`` run in a process of its own;
- ``project_side``: a ``rollout-trainer`` run against the benchmark's service;
- ``alone``: each side measured alone, then both at once (the ideal steps/s);
- ``cpu_use``: core-seconds by CPU and by process, and vLLM's engine steps;
- ``training_window``: those readings, and the service's, from a run's first step to its last;
- ``processes``: the child processes' cores, environment and output;
- ``report``: the tables and lines the benchmark prints.

The entry point, its arguments and the order of the runs stay in ``bench_vs_trl.py``; every
module here is imported with ``benchmarks/`` on ``sys.path``, as the benchmark scripts are.
"""
