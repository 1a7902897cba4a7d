"""HTTP layer: Starlette app, routes, request schemas, the one error table, auth, request ids."""
