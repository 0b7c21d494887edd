"""What an operator sees: every Prometheus series this project defines, and the KV figures.

``series`` is the one catalogue (name, kind, help, labels, buckets) the controller
(``deployments.control.metrics``) and the serving path's timing middleware
(``deployments.http.timing``) create their Ray metrics from, and the list the Grafana
dashboard (``k8s/monitoring/``) is checked against. ``capacity`` turns ``dsv4-serve
plan``'s figures (``deployments.plan``) into the per-node-type rows the controller
exports; ``scrape`` reads a Prometheus scrape back into per-replica figures
(``dsv4-serve status --metrics``). Floor 3: imports ``config``, ``plan`` and
``control.wire`` (its models).
"""
