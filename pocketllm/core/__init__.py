"""The leaf of the layering: the types every other package shares (a request and its state, the
scheduler's output, a step's flattened inputs, the KV layout, GGUF's type tables, named model
shapes). Nothing here imports another pocketllm package but `errors` and `sampling_params`."""
