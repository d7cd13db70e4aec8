"""Framework rules as layout constructors: each module turns one framework's parallel
configuration into a :class:`reshard.Layout` of a model's logical (Hugging Face-named) tensors."""
