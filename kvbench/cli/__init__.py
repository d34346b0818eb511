"""What the command line entry (:mod:`kvbench.__main__`) calls before Hydra runs, also read by
:mod:`kvbench.reproduce` and the scripts that plan sweeps:

- :mod:`kvbench.cli.nodes`: the config nodes a command line chooses (where they are looked up, the
  experiments and what each needs), checked in one line each;
- :mod:`kvbench.cli.compose`: composing a command line with Hydra (each job's config, a sweep's
  jobs, Hydra's errors as one line, Hydra's output folder).
"""
