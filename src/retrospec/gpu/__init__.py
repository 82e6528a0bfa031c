"""The GPU runbook (issue 21): everything a session with a lent GPU machine runs, written and rehearsed on CPU.

A lent machine is bare and brief: each ``run`` call sends the repository's working tree (tracked and
untracked-not-ignored files) plus at most 8 carried ignored paths, 64 MiB in all; a command runs at most 10 minutes;
files written outside the tree survive only while the machine stays warm (30 s after a call); at most 8 files of
at most 16 MiB come back from ``$OUT``; there is no network there, and its stack is older (torch 2.11,
transformers 5.17).

Modules:

- ``plan``: the budget arithmetic and the ordered list of device calls (command string, carry list, timeout, what
  comes back). ``retrospec gpu plan`` prints it; a test checks every command is <= 2000 characters and every
  carry list fits.
- ``prepare``: ``make gpu`` here: the carry folders under ``.gpu/`` (the real model's GGUF in parts that fit one
  call each, the CPU reference logits, the bench prompts) and the list of wheels the machine lacks (``.whl/``).
- ``common``: device choice, synchronized timing, JSON output, the device-side staging folder, tiny models.
- ``steps_*``: one function per step; each runs with ``dry_run=True`` on CPU with tiny models in seconds, through
  the same code as on CUDA, and writes ``<step>.json`` (every figure) into ``--out``.
- ``report``: ``retrospec gpu report DIR...``: those JSON files -> ``docs/gpu.md``-ready markdown tables.

Invariants: nothing here makes the project need a GPU (CUDA is chosen only when asked for and present); nothing
here edits another module's behaviour (no monkey-patching); every step ends inside its ``--budget-s`` and writes
its JSON even when a part of it fails (the failure is recorded in the JSON, the step's exit code is 1).
"""

STEPS = ("tests", "kernels", "costmodel", "stage", "model", "bench", "train")
