"""The web face of the product: the Gradio page, its HTTP API and the service routes beside it."""
