"""lmserve on Ray Serve: ``lmserve cluster`` (docs/cluster.md).

Replicas, each a whole lmserve engine, behind one ingress that routes a conversation to the
replica holding its KV. Ray is an optional extra (``pip install lmserve-core[ray]``): only
:mod:`.command`, :mod:`.deployments` and :mod:`.router` import it; :mod:`.wire` does not.
"""
