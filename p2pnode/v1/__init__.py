"""Generated gRPC code for protos/p2pnode/v1 (scripts/gen_protos.py). Do not edit."""
