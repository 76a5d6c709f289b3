"""The special tokens of OpenAI's harmony format (gpt-oss's o200k_harmony vocabulary)."""

START, CHANNEL, MESSAGE, CONSTRAIN, END = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>"
CALL, RETURN = "<|call|>", "<|return|>"
MARKUP = (START, CHANNEL, MESSAGE, CONSTRAIN, END)  # a message's special tokens, kept in decoded text
