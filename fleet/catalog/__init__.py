"""The catalog: what the fleet knows, in the object store — versions, tenants, policies,
routes, the gateways' directory and rollouts' stored state."""
