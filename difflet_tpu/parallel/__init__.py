"""How the slice is used: meshes, the parallel modes, the collective matmuls, padding, multi-host.

  mesh               `make_mesh`: `cfg` x `data` x `tp` meshes, each `tp` group a ring of single ICI hops
  modes              `Parallel` (single, TP, SP, sp-xla) and parallel plans -> PartitionSpecs
  collective_matmul  the bidirectional all-gather + matmul and matmul + reduce-scatter rings, their dispatch
  padding            eager token padding and key masks (every rank runs one identical program)
  distributed        multi-host runs on `jax.distributed`

Nothing is re-exported here: `config` imports `mesh`, and `modes` imports `config`.
"""
