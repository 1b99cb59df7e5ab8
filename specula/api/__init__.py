"""The contract shared by the operator and the runtime: pydantic models of the
``SpeculativeModel`` custom resource, CRD generation, and the runtime config."""
