"""Front doors into other libraries: each module adapts jitattn to one of them (transformers,
torch's flash-attention registry).

`import jitattn` imports only torch_registry (it imports no torch: it puts "jitattn" into torch's
registry when torch loads); every other module imports its library only when used.
"""
