"""The KV-spec controller: what each replica should store, what it does, and what follows.

Bottom to top: ``replica_wire`` and ``wire`` (the typed messages between worker, replica
and controller, the fleet report, and their JSON schema; import them from ``wire``),
``summary`` (a replica's worker reports condensed), ``prediction`` (the byte model's
expectation for one replica's node), ``verdict`` (the fleet: each replica against its
prediction, then against its peers), ``answers`` (a replica's answer validated on
receipt), ``enforcement`` (what a policy does about an odd replica), ``metrics`` (the
Prometheus series of the verdict and of each replica's KV), ``controller`` (the Serve
deployment that runs the check), ``report`` (the verdict for people). Imports ``config``,
``dsv4_patch`` and the series catalogue ``observe.series`` only.
"""
