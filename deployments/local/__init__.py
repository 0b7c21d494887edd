"""Running the stack on this machine: a private Ray cluster, deploy, drain, a client.

``ray_head`` (the one-node cluster ``dsv4-serve run`` owns), ``cluster`` (a local
multi-node cluster grown by Ray's autoscaler), ``deploy`` (our apps onto a running
cluster), ``drain`` (Ctrl-C/SIGTERM without orphans), ``client`` (stdlib HTTP for our
own endpoints). Above ``deployments.app``; below the CLI.
"""
