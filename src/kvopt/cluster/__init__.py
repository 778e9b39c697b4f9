"""kvopt on a Ray cluster (``pip install kvopt[cluster]``): engine replicas behind a KV-aware router, and batch jobs.

:mod:`app` builds the Ray Serve application (``kvopt serve --replicas N``); :mod:`replica` is one engine replica,
:mod:`ingress` the OpenAI-compatible API on them (:mod:`kvopt.serving`'s handlers), :mod:`router` the Ray Serve
request router that sends a prompt to the replica holding its leading KV blocks (:mod:`keys`: the engine's chained
block hashes; :mod:`index`: who holds what, and the rule); :mod:`batch` runs ``kvopt batch --ray`` on Ray Data.
Ray is imported only by the modules that need it.
"""

from kvopt.cluster.app import ClusterConfigError, ClusterSpec, build, connect, serve_cluster

__all__ = ["ClusterConfigError", "ClusterSpec", "build", "connect", "serve_cluster"]
