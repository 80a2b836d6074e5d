"""`fairlane simulate` (`python -m fleetsim`): the production scheduler core over N
simulated workers, in virtual time.

Modules: `records` (the contract between the parts), `workload` (what arrives when),
`fleet` (the discrete-event loop: `PoolCore` + `gpu_worker.sim.batch.BatchCore` per
worker), `recorder` (streaming, memory-bounded statistics), `report` (markdown, JSON,
PNG plots), `cli` (the command).
"""
