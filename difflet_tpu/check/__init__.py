"""`python -m difflet_tpu.check`: one command that proves a TPU slice (docs/first-hour.md).

On a TPU: every port's tiny preset against float64 references (`numerics`),
both Pallas kernels at every collective-matmul site of every bench case
against the plain collectives and the streaming kernels' credit paths
(`sites`), op-level and step timings beside the estimator's price of the same
programs (`sites`, `steps`), and a JSON + Markdown report (`report`) that
`python -m difflet_tpu.tools.calibration --from-check` refits the estimate
on. Off TPU the same command runs the CPU / interpret-mode path and says that
nothing was timed; `--compile-only --topology v5e:2x2` compiles the TPU
path's kernel sites and steps deviceless. Tooling: the runtime never imports it.
"""
