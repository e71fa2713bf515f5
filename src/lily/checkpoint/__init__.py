"""Checkpoints on disk: what a Qwen3.5/3.6 MoE checkpoint holds and how lily reads, converts and makes one.

    config          config.json -> TextConfig (the model's shape)
    tensors         the one list of the model's tensors: names, shapes, which are quantized
    dtypes          float encodings (bf16, fp8, ...) and their numpy conversions
    safetensors_io  reading and writing .safetensors shards (lazily, checked), finding a checkpoint's shards
    quant           MLX affine 4/8-bit quantization
    convert         Hugging Face layout -> MLX layout (also what Model.load(quantize=...) runs)
    weights         a checkpoint folder -> the tensors the core engine loads
    synthetic       random checkpoints of any config (tests, benchmarks, the tiny built-in model)
    hub             where a checkpoint comes from: a local folder or a Hugging Face repo id
    tiny            the tiny built-in checkpoint, made once and cached

The modules here import each other and lily.errors / lily._core only (and tiny imports
lily.tokenizer_files for the tokenizer files it writes); nothing here imports the model or the server.
"""
