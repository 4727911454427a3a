"""Offline tools that make the embedded models, kept beside the runtime package: the app never imports them."""
