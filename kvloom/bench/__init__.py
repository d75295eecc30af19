"""Load testing: ``engine bench serve`` (a load generator for OpenAI-compatible servers) and ``engine bench
ab`` (the same load against one server per plugin combination)."""
