"""Tokenizers (``byte``: the random model's; ``hf``: a checkpoint's ``tokenizer.json``) and
the streaming ``detokenizer``. No paddle."""
