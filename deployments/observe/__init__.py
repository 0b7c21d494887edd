"""What an operator sees: every Prometheus series this project defines, read back.

``series`` is the one catalogue (name, kind, help, labels, buckets) the controller
(``deployments.control.metrics``) and the serving path's timing middleware
(``deployments.http.timing``) create their Ray metrics from, and the list the Grafana
dashboard (``k8s/monitoring/``) is checked against; ``scrape`` reads a Prometheus
scrape back into per-replica figures (``dsv4-serve status --metrics``); ``buckets`` is a
histogram's state as Prometheus exposes it, which the replica keeps vLLM's engine
histograms in (``deployments.serving.engine_metrics``). Pure: it
imports nothing of the project but itself, so the controller below ``plan`` can use
it. The KV capacity rows the controller exports come from ``plan.kv_figures``.
"""
