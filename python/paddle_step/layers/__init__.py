"""Building blocks of the model's forward pass: the paged KV cache and flat batch
(``paged_attention``), the dense blocks (``dense_blocks``) and sampling (``sampler``)."""
