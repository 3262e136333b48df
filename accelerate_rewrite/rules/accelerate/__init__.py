"""The Fabric plan spelled in Hugging Face Accelerate's API (--backend accelerate)."""
