"""Build a tiny, random-init Llama model with a real locally trained tokenizer, for fast offline tests.

The folder it writes has the same shape as a real base model folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, chat template), so the engine, the sampler and the tinker SDK's
tokenizer loading all run their real code paths against it in well under a second.
"""

from __future__ import annotations

from pathlib import Path

# Special tokens mirror SmolLM2-Instruct's (ids 0, 1, 2 in this order), so code exercised on the tiny model
# meets the same chat markers and stop token it meets on the embedded default.
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Enough ordinary English that the BPE merges cover common words; byte-level BPE still encodes any text.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A tiny model learns to repeat what it sees.
Training a language model means predicting the next token from the tokens before it.
The capital of France is Paris. The capital of Italy is Rome. The capital of Japan is Tokyo.
What is the answer? The answer is forty two. Please think step by step, then answer the question.
One, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 10 100 1000.
User: hello there! Assistant: Hello, how can I help you today? I am a helpful assistant.
Write a short poem about the sea. The waves are blue and the sky is wide and the wind is cold.
Low rank adapters train a small number of weights on top of a frozen base model.
Each tenant trains its own adapter, and the server runs many adapters in the same batch.
The learning rate, the batch size and the number of steps decide how fast the loss goes down.
She said that the weather would be nice, so they went outside and walked in the park.
It was a bright cold day in April, and the clocks were striking thirteen.
"""


def build_tiny_model(
    folder: Path, *, seed: int = 0, vocab_size: int = 384, num_attention_heads: int = 4, num_key_value_heads: int = 2,
    logit_scale: float = 1.0,
) -> Path:
    """Write a tiny Llama causal LM and its tokenizer to ``folder`` and return ``folder``.

    Deterministic for given arguments: the tokenizer training is, and the weights come from a seeded generator, so
    two builds give byte-identical tokenizer.json and model weights. The default head_dim is 16; vLLM's CPU attention
    needs 32 or more, which ``num_attention_heads=2, num_key_value_heads=1`` gives (tests/vllm). ``logit_scale``
    multiplies the output head: above 1 the next-token distributions are sharper than the near-uniform ones of a
    random init (a distillation teacher that differs measurably from a student).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save_pretrained(folder)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids(IM_START),
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(ENDOFTEXT),
    )
    # fork_rng keeps the caller's global RNG state untouched by the seeded init.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def train_tokenizer(vocab_size: int) -> object:
    """Train a byte-level BPE on the built-in corpus and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if not 256 + len(SPECIAL_TOKENS) < vocab_size <= 4096:
        raise ValueError(f"vocab_size must leave room for merges above the 256 bytes and stay small, got {vocab_size}")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=IM_START,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=ENDOFTEXT,
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )
