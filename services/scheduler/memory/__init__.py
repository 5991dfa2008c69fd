"""KV memory: page allocator, ReqToTokenPool, radix cache, and the manager that composes them."""
