"""Model architectures, one file each, named as Hugging Face's classes."""
