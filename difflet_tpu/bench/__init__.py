"""`python -m difflet_tpu.bench`: the denoise benchmark (TP vs SP) and compile-only estimates.

  cli           the command line: flags, their validation, `main`
  cases         what one case is: model, preset, shape, guidance, mesh, Config
  run           the timed run on devices (TPU slice or CPU devices)
  compile_only  `--compile-only`: deviceless compiles for a TPU topology, HBM and the ESTIMATE
  report        tables and the JSON report

This is tooling: it imports the runtime and difflet_tpu.tools; the runtime never imports it.
"""
