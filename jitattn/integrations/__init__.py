"""Front doors into other libraries: each module adapts jitattn to one of them (transformers).

Nothing here is imported by `import jitattn`; a module imports its library only when used.
"""
