"""The engine core: config, requests, scheduler, paged KV cache, model runner and the step loop."""
