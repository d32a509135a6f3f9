"""Plumbing: what the numbered files need to run, but not what they teach. Skip it on a first read.

    launch.py      one code path from 1 CPU rank to a cluster: fork-started gloo ranks on a laptop,
                   torchrun's environment (NCCL) on GPUs; failures and hangs become clear errors
    cli.py         the command line generated from the config dataclasses (help from field comments)

Nothing here imports a numbered file: the numbered files import this package, never the reverse.
"""
