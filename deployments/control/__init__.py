"""The KV-spec controller: what each replica should store, what it does, and what follows.

Bottom to top: ``wire`` (the typed messages between worker, replica and controller, and
their JSON schema), ``summary`` (a replica's worker reports condensed), ``prediction``
(the byte model's expectation for one replica's node), ``verdict`` (the fleet: each
replica against its prediction, then against its peers), ``enforcement`` (what a policy
does about an odd replica), ``controller`` (the Serve deployment that runs the check),
``report`` (the verdict for people). Imports ``config`` and ``dsv4_patch`` only.
"""
