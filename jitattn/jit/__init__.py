"""The JIT pipeline: spec -> render -> build -> cache -> load. See docs/cache.md and docs/design.md."""
