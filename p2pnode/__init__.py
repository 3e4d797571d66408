"""p2pnode: a decentralized, prefix-cache-aware LLM serving mesh."""

__version__ = "0.1.0"
