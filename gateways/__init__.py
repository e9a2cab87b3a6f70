"""HTTP gateways over strop's gRPC services (DESIGN.md, "Protocols: one gRPC core, two HTTP gateways")."""
