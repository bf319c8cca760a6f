from pagoda.layers.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend
from pagoda.layers.attention.paged_kv import PagedKVCache

__all__ = ["AttentionBackend", "AttentionMetadata", "PagedKVCache", "get_attention_backend"]
