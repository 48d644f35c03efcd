"""Size limits shared by the wire, the configuration and the screening (each defined once, here)."""

from __future__ import annotations

MAX_MESSAGE_MB = 256  # the default largest gRPC / Flower message, in MiB (federation.max_message_mb)
MAX_MESSAGE_BYTES = MAX_MESSAGE_MB * 2**20
# the default of security.max_bytes_per_token: no tokenizer in use here has a token longer than this in UTF-8
MAX_BYTES_PER_TOKEN = 32
