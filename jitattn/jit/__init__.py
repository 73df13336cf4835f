"""The JIT pipeline: spec -> render -> build -> cache -> load. See README "How the cache works"."""
