"""scripts/gpu-check: verify and measure the GPU path within the device machine's budget.

The GPU machine is lent rarely, 15 minutes of machine time in all, at most 10 minutes a command, and
starts bare: no network, no JIT cache. So everything is prepared here and each phase is one command
that returns its most telling results first, writing them as it goes (docs/gpu.md):

    scripts/gpu-check prepare          here: the wheels it lacks into .gpu-wheels/, the size checked,
                                       the device call for each phase printed
    scripts/gpu-check phase1           there: install, versions, probe, parallel JIT, tests/gpu
    scripts/gpu-check phase2           there: install, versions, JIT, benchmarks/gpu --preset check
    scripts/gpu-check phase2 --arch qwen3_moe   the same for the MoE model, its decode stages only
    scripts/gpu-check --rehearse       here: both phases on CPU with the tiny model, CUDA steps skipped

The modules, one job each: cli (the commands), wheels (prepare), env (the steps' Python
environment), runner (a phase: steps under limits, logs, the summary), phases (the two phases'
steps), groups (tests/gpu in three processes), and the step programs versions, probe and jit.
"""
