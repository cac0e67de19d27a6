"""What a running job is limited by: telemetry while it runs, and the bottleneck verdict.

    telemetry   disk, CPU, data-wait and GPU samplers; per-step profile records
    bottleneck  windows → a verdict (data-bound, compute-bound, …) with its evidence and remedy

May import: the shared core. Never a stage.
"""
