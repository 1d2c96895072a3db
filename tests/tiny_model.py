"""Write a tiny random qwen2/llama GGUF model with a real (small) byte-level BPE vocabulary.

The file goes through the same loader, tokenizer and model code as the real
models, and HF transformers can load it too, so it doubles as a numerics check
that runs in seconds.
"""

from __future__ import annotations

import functools
import json

import gguf
import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5-Coder's fill-in-the-middle tokens (fim=True)
FIM_SPECIALS = ["<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]

_CORPUS = """
def add(a, b):
    return a + b

class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)

The quick brown fox jumps over the lazy dog. Hello, world! How are you today?
for i in range(10): print(i * i)
import numpy as np; x = np.zeros((3, 4)); y = x.sum(axis=0)
Once upon a time there was a small model that wanted to be served quickly.
"""


def quantize_q5_k(arr: np.ndarray) -> np.ndarray:
    """A float32 matrix [rows, K] (K a multiple of 256) as Q5_K blocks [rows, K / 256 * 176], which
    gguf's numpy quantizers lack: per 32 elements a 6-bit scale and min under the super-block's fp16
    d and dmin, then 5-bit values (a plain rounding, not llama.cpp's search for the best scales)."""
    rows, k = arr.shape
    x = arr.reshape(-1, 8, 32).astype(np.float32)
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 31
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (-lo.min(-1) / 63).astype(np.float16)
    df, mf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(np.divide(-lo, mf, out=np.zeros_like(lo), where=mf > 0)), 0, 63).astype(np.uint8)
    step, offset = (df * sc)[..., None], (mf * m)[..., None]
    q = np.clip(np.round(np.divide(x + offset, step, out=np.zeros_like(x), where=step > 0)), 0, 31).astype(np.uint8)
    out = np.zeros((len(x), 176), dtype=np.uint8)
    out[:, 0:2] = d.reshape(-1, 1).view(np.uint8)
    out[:, 2:4] = dmin.reshape(-1, 1).view(np.uint8)
    # 12 bytes: scales and mins 0-3 (low 6 bits, with the top 2 bits of 4-7), then 4-7's low nibbles.
    out[:, 4:8] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    out[:, 16:48] = (((q >> 4) & 1) << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8)  # qh
    nib = q & 0x0F  # 4 runs of 32 bytes: sub-block 2r in the low nibbles, 2r + 1 in the high
    out[:, 48:176] = (nib[:, 0::2] | (nib[:, 1::2] << 4)).reshape(-1, 128)
    return out.reshape(rows, -1)


@functools.lru_cache(maxsize=4)
def _bpe_vocab(pre: str, vocab_size: int = 400) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Train a byte-level BPE (the same pre-tokenizer family as qwen2/llama3) on a fixed corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    split = {
        "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }[pre]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tuple(t for t, _ in vocab), tuple(merges)


def write_tiny_gguf(
    path,
    arch: str = "qwen2",
    *,
    n_layers: int = 2,
    hidden: int = 64,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    ffn: int = 128,
    context: int = 512,
    tied: bool = False,
    quantized: bool = True,
    seed: int = 0,
    scale: float = 0.2,
    noise: float = 0.0,
    chat_template: str = CHATML_TEMPLATE,
    qtypes: tuple[str, ...] = (),
    fim: bool = False,
    rope_scaling: dict | None = None,
) -> str:
    """Write the model; returns the path. Weights ~ N(0, scale); some matrices stored as Q8_0 / F16.
    noise > 0 adds N(0, noise * scale) to every matrix of the seed's model: a related model (a
    speculative draft that agrees with the noise-free one on some tokens). qtypes: GGML types the
    layers' matrices take in turn instead (Q5_K needs widths that are multiples of 256). fim: the
    vocabulary has Qwen2.5-Coder's fill-in-the-middle tokens too. rope_scaling: rope.scaling.* keys."""
    pre = "qwen2" if arch == "qwen2" else "llama-bpe"
    tokens, merges = _bpe_vocab(pre)
    specials = SPECIALS + (FIM_SPECIALS if fim else [])
    tokens = list(tokens) + specials
    types = [gguf.TokenType.NORMAL] * (len(tokens) - len(specials)) + [gguf.TokenType.CONTROL] * len(specials)
    vocab = len(tokens)
    eos = tokens.index("<|im_end|>") if arch == "qwen2" else tokens.index("<|endoftext|>")

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_block_count(n_layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if arch == "llama":
        w.add_rope_dimension_count(hidden // n_heads)
        w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(merges))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(eos)
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(arch == "llama")
    w.add_chat_template(chat_template)
    for key, value in (rope_scaling or {}).items():  # {"type": "yarn", "factor": 4.0, ...}: rope.scaling.*
        (w.add_string if isinstance(value, str) else w.add_uint32 if isinstance(value, int) else w.add_float32)(
            f"{arch}.rope.scaling.{key}", value)

    rng = np.random.default_rng(seed)
    head_dim = hidden // n_heads

    def mat(rows, cols, s=scale):
        return (rng.standard_normal((rows, cols)) * s).astype(np.float32)

    noise_rng = np.random.default_rng(seed + 1000)

    def add(name, arr, fmt="f32"):
        if noise and arr.ndim == 2:
            arr = arr + (noise_rng.standard_normal(arr.shape) * noise * np.abs(arr).mean()).astype(np.float32)
        if fmt == "Q5_K":
            q = quantize_q5_k(arr)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q5_K)
        elif fmt.upper() in ("Q8_0", "Q4_1", "Q5_1", "Q5_0", "Q4_0"):
            t = gguf.GGMLQuantizationType[fmt.upper()]
            q = gguf.quants.quantize(arr, t)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=t)
        elif fmt == "f16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, arr)

    qfmt = "q8_0" if quantized else "f32"
    turns = iter(qtypes * (7 * n_layers)) if qtypes else None

    def layer_fmt(default):
        return next(turns) if turns else default

    add("token_embd.weight", mat(vocab, hidden, 1.0), "f16" if quantized else "f32")
    add("output_norm.weight", (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    if not tied:
        add("output.weight", mat(vocab, hidden), qfmt)
    for i in range(n_layers):
        p = f"blk.{i}."
        add(p + "attn_norm.weight", (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        add(p + "ffn_norm.weight", (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        add(p + "attn_q.weight", mat(n_heads * head_dim, hidden), layer_fmt(qfmt))
        add(p + "attn_k.weight", mat(n_kv_heads * head_dim, hidden), layer_fmt(qfmt))
        add(p + "attn_v.weight", mat(n_kv_heads * head_dim, hidden), layer_fmt("f16" if quantized else "f32"))
        add(p + "attn_output.weight", mat(hidden, n_heads * head_dim), layer_fmt(qfmt))
        if arch == "qwen2":
            add(p + "attn_q.bias", (0.1 * rng.standard_normal(n_heads * head_dim)).astype(np.float32))
            add(p + "attn_k.bias", (0.1 * rng.standard_normal(n_kv_heads * head_dim)).astype(np.float32))
            add(p + "attn_v.bias", (0.1 * rng.standard_normal(n_kv_heads * head_dim)).astype(np.float32))
        add(p + "ffn_gate.weight", mat(ffn, hidden), layer_fmt(qfmt))
        add(p + "ffn_up.weight", mat(ffn, hidden), layer_fmt(qfmt))
        add(p + "ffn_down.weight", mat(hidden, ffn), layer_fmt(qfmt))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
