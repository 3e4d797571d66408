"""The protocol-neutral serving core: admission, the ingress (route, serve here or relay, retry, drain, count), local
serving on the engine, forwarding between nodes (both ends of the Forward RPC, and a request's wire form), KV pulls,
a request's segments, and the core's own error codes. The front doors (``p2pnode/api``) are thin adapters over it.
"""
