"""The GPU runbook: everything a session with a lent GPU machine runs, written and rehearsed on CPU.

Development tooling, not the library: it encodes one lab's device procedure (limits per call, command lengths,
device minutes) and lives outside ``src/``. Run it from the repository root: ``python -m tools.gpu
plan|prepare|slim|step|report`` (``cli``), or the Makefile's ``gpu``, ``gpu-done`` and ``gpu-dry-run``. It imports
the library (``retrospec``); the library never imports it.

A lent machine is bare and brief (no network, an older stack: torch 2.11, transformers 5.17; limits in ``plan``).
``plan``: the budget arithmetic and the ordered device calls; ``prepare``: ``make gpu``, the carry folders;
``common``: device choice, timing, JSON output; ``steps_*``: one function per step, each writing ``<step>.json``
into ``--out`` and dry-runnable on CPU with tiny models through the same code as on CUDA; ``report``: those JSON
files -> ``tools/gpu/README.md``-ready markdown.

Invariants: nothing here makes the project need a GPU (CUDA is chosen only when asked for and present); nothing
here edits another module's behaviour (no monkey-patching); every step ends inside its ``--budget-s`` and writes
its JSON even when a part of it fails (the failure is recorded in the JSON, the step's exit code is 1).
"""

STEPS = ("tests", "kernels", "costmodel", "stage", "model", "bench", "train")
